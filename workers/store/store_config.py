"""The prefix store's configuration and its cold formats' names, without torch: the settings of
every stage read them, and only the ranking worker computes with tensors.

Primitives:
- ``ColdFormat``, ``COLD_FORMATS``: the names of the cold tiers' formats (``kv_formats`` encodes
  them).
- ``PrefixStoreConfig``: one worker's prefix store, its tiers' budgets and policies
  (``prefix_store.PrefixStore`` takes it).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from relaygr.workers.store.leases import DEFAULT_LEASE_TTL_S

DEFAULT_PAGE_TOKENS = 32
"""Tokens a page of the device tier holds (``kv_pages.DEFAULT_PAGE_TOKENS``; named here without torch)."""

ColdFormat = Literal["exact", "bf16", "int8"]
COLD_FORMATS: tuple[str, ...] = get_args(ColdFormat)


class PrefixStoreConfig(BaseModel):
    """Configuration of one worker's prefix store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(
        "cpu", description="Device of the device tier: the model's device ('cpu', 'cuda', 'cuda:1', 'npu:0')."
    )
    device_budget_bytes: int = Field(
        1 << 30, ge=0, description="Byte budget of the device tier (pinned and unpinned entries together)."
    )
    page_tokens: int = Field(
        DEFAULT_PAGE_TOKENS,
        ge=1,
        description="Tokens a page of the device tier holds: a prefix takes whole pages (half a page wasted on average).",
    )
    host_budget_bytes: int = Field(4 << 30, ge=0, description="Byte budget of the host-memory tier.")
    disk_path: str | None = Field(
        None, description="Folder of the disk tier (blob files and their index); None disables it."
    )
    disk_budget_bytes: int = Field(16 << 30, ge=0, description="Byte budget of the disk tier (stored bytes).")
    default_lease_ttl_s: float = Field(
        DEFAULT_LEASE_TTL_S, gt=0, description="Lease lifetime when lease() is called without a TTL."
    )
    pin_host_memory: bool | None = Field(
        None,
        description="Pin host-tier tensors for fast host-to-device copies; None: when the device is CUDA.",
    )
    disk_write_policy: Literal["write_back", "write_through"] = Field(
        "write_back",
        description=(
            "write_back: an entry is written to disk when it is demoted from host (and at close); "
            "write_through: every put is also written to disk in the background."
        ),
    )
    disk_backlog_bytes: int = Field(
        512 << 20,
        ge=0,
        description="Most bytes of prefixes waiting for the disk writer; a write beyond it is dropped and counted.",
    )
    cold_kv_format: ColdFormat = Field(
        "exact",
        description=(
            "How the host and disk tiers store keys and values: exact (the model's dtype), bf16, or "
            "int8 with a float16 scale per token and head. The device tier is always exact."
        ),
    )
    persist_on_close: bool = Field(
        True, description="At close, write memory entries that the disk lacks so that a restart finds them."
    )
    purge_other_model_versions: bool = Field(
        True, description="At open, delete disk entries computed by another model version."
    )
