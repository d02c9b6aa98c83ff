"""The proxy service: the OpenAI-compatible HTTP front of an EPD cluster.

A thin shell around five wings. The shell: ``main`` (``epd proxy``: flags -> ``ProxyConfig``, uvicorn),
``flags`` and ``request_flags`` (the flags and their ``--help`` groups, importing nothing heavy),
``app`` (the routes and the generation handlers), ``intake`` (a body from the wire to a checked request),
``info_endpoints`` (models, health, metrics), ``lifespan`` (builds ``ProxyState`` and tears it down),
``state`` (``ProxyState``: what handlers share) and ``config`` (``ProxyConfig``). The wings, one package
each:

- ``dispatch``: one request's attempts over encoders and PDs (E+PD and E+P+D);
- ``web``: HTTP plumbing (middleware, bounded reads and writes, per-client limits);
- ``openai``: the protocol (request schemas and checks, response objects, the OpenAPI document);
- ``prompt``: messages, images and videos -> ``Prompt``, on bounded work pools;
- ``backends``: the instances, where they are, their health and load, the routing policies.

Below the wings, modules they share: ``metrics`` (Prometheus; it reads the backends' instances), then
``errors`` (what the proxy answers), ``trace`` (request ids and a request's measurements), ``faults``
(test-only fault injection) and ``cache_isolation`` (per-tenant cache salts).

Layers, highest first: a module imports only from its own layer's module or from layers below it; the
modules of one layer (``|``) are independent of each other. pyproject.toml's import-linter contracts
enforce this and that no import circle exists anywhere in the proxy:

    main > app | flags > intake | lifespan | info_endpoints | request_flags > state > config
      > dispatch | web > openai | prompt > metrics > backends
      > errors | trace | faults | cache_isolation
"""
