"""Proxy integration fixture: doubles + a started proxy app + an HTTP client."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import uvicorn
from proxy_doubles import Cluster, proxy_config, start_doubles

from services.proxy.app import create_app


@pytest.fixture
async def cluster_factory(tiny_model_dir):
    """Builds doubles + proxy (in-process ASGI client); ``http=True`` serves over real HTTP (uvicorn)."""
    stack: list = []

    async def make(num_pds: int = 1, num_encoders: int = 1, http: bool = False, fetcher=None, **overrides) -> Cluster:
        cluster = await start_doubles(num_pds, num_encoders)
        stack.append(("servers", cluster))
        app = create_app(proxy_config(tiny_model_dir, cluster, **overrides), fetcher=fetcher)
        cluster.app = app
        if http:
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
            task = asyncio.create_task(server.serve())
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            cluster.base_url = f"http://127.0.0.1:{port}"
            cluster.client = httpx.AsyncClient(base_url=cluster.base_url, timeout=10)
            stack.append(("uvicorn", (server, task)))
        else:
            lifespan = app.router.lifespan_context(app)
            await lifespan.__aenter__()
            stack.append(("lifespan", lifespan))
            cluster.client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=10
            )
        stack.append(("client", cluster.client))
        return cluster

    yield make
    for kind, thing in reversed(stack):
        if kind == "client":
            await thing.aclose()
        elif kind == "lifespan":
            await thing.__aexit__(None, None, None)
        elif kind == "uvicorn":
            server, task = thing
            server.should_exit = True
            await task
        elif kind == "servers":
            # Every Generate on the doubles has ended (finished or cancelled): nothing is left in flight.
            for _ in range(100):
                if all(pd.num_active == 0 for pd in thing.pds):
                    break
                await asyncio.sleep(0.02)
            assert all(pd.num_active == 0 for pd in thing.pds), "a Generate stream was left open"
            # Every per-client allowance was given back (success, error, disconnect or stream end).
            state = getattr(getattr(thing.app, "state", None), "proxy", None)
            if state is not None:
                for _ in range(100):
                    if not state.limiter.num_in_flight:
                        break
                    await asyncio.sleep(0.02)
                state.limiter.check_idle()
            for server in thing.servers:
                await server.stop(0)
