"""``use_existing_store``: the branch the pipeline takes when ``plan_dump`` found the store complete.

No accelerator is provisioned and no teacher is loaded: this CPU task only
passes the store's state on to verify (whose cache key it is) and says so in
the log. (kfp.local resolves ``dsl.OneOf`` for parameters only, so the store
artifact itself comes from ``plan_dump`` in both branches.)
"""

from typing import NamedTuple

from kfp import dsl

from .image import DEFAULT_IMAGE


def use_existing_store(store_uri: str, store_state: str) -> NamedTuple("ExistingStore", [("store_state", str)]):
    """Pass the complete store's state on; nothing is computed."""
    import collections

    print(f"use_existing_store: {store_uri} is complete; the dump is skipped (state {store_state})", flush=True)
    return collections.namedtuple("ExistingStore", ["store_state"])(store_state)


INPUTS = {
    "store_uri": "The complete store (from plan_dump).",
    "store_state": "Digest of its committed chunk names (from plan_dump).",
}


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import describe

    return dsl.component(describe(use_existing_store, INPUTS), base_image=image, install_kfp_package=False)


component = build()
