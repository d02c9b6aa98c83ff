"""``epd bench multiturn``: multi-turn image chats over several PDs, PD routing policies side by side.

``command`` (flags and ``run``), ``conversations`` (the seeded chats and their request bodies), ``runner``
(a cluster per policy and PD count, the users, the proxy's counters) and ``report`` (numbers per policy,
the table). Clusters, the streaming client and the statistics are ``epd bench serve``'s (``serve.procs``,
``serve.client``, ``serve.stats``).

May import: ``services.common`` and the other bench modules; services only as processes, never as Python
modules.
"""
