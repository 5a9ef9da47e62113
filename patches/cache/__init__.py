"""The holed radix cache and what it stores: prompts shared under eviction, compacted histories
(page size 1 and > 1), the host tier and recall."""
