"""What keeps a request's images computable: embedding references, or pinned K/V in their place. Pure Python.

A request takes one embedding reference per image span at Generate (or, for
an image its cached prefix already covers, holds those blocks pinned). From
the step that fills the KV block holding its last image token it needs the
embeddings only to recompute after a preemption, and the cached blocks
through that token serve that recompute as well (re-admission claims them as
its prefix). So they are pinned and the references dropped: the embeddings
stay cached but evictable, and a few long generations no longer hold the
embedding cache against every other image request. A preempted request
takes its references back when every image is still cached, which frees its
pinned blocks for others; otherwise it recomputes from them. Without prefix
caching no block can be pinned, and the references stay until the end.
"""

from __future__ import annotations

from services.pd.engine.embedding_cache import EmbeddingCache
from services.pd.engine.kv_cache import KVCacheManager
from services.pd.engine.request import Request


def let_go_of_computed_images(request: Request, kv_cache: KVCacheManager, embedding_cache: EmbeddingCache) -> None:
    """Trades ``request``'s image references for pinned K/V once its images are computed into full blocks."""
    if not request.span_refs:
        return
    images_end = request.mm_spans[-1].end
    if kv_cache.pin_computed_prefix(request, kv_cache.num_blocks_for(images_end)):
        release_images(request, embedding_cache)


def retake_images(request: Request, kv_cache: KVCacheManager, embedding_cache: EmbeddingCache) -> bool:
    """Trades a queued request's pinned K/V back for image references when every image it lacks one
    for is still cached, freeing the pinned blocks for others; False, holding what it held, if not."""
    missing = [i for i in range(len(request.mm_spans)) if i not in request.span_refs]
    taken: list[int] = []
    for index in missing:
        if not embedding_cache.acquire(request.mm_spans[index].mm_hash):
            break
        taken.append(index)
    if len(taken) < len(missing):
        for index in taken:
            embedding_cache.release(request.mm_spans[index].mm_hash)
        return False
    request.span_refs.update(taken)
    kv_cache.unpin(request.request_id)
    return True


def release_images(request: Request, embedding_cache: EmbeddingCache) -> None:
    """Drops every embedding reference ``request`` holds."""
    for index in sorted(request.span_refs):
        embedding_cache.release(request.mm_spans[index].mm_hash)
    request.span_refs.clear()
