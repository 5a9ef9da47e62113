"""Test-side oracles of the eviction policies and the recall rule, written from the papers.

They import torch and the standard library only, never `sgl_vtoken` or `patches`
(`test_independent.py`), so a test that compares the server with them checks the policies, not
only the plumbing. `oracle_policy(cfg, rid)` (the definitions) and `ORACLE_RECALL` plug into
`sgl_vtoken_tools.hf_reference` (its `policy=` and `recall=` arguments).

    keep         the keep rule: protected tokens, then the best scores; ties keep the later
    scores       position (StreamingLLM), key norm, seeded hash (random), aggregation, pooling
    statistics   H2O's accumulated attention, TOVA's last query, Scissorhands' persistence
    recall       the host tier's recall: split, rounds, candidate mass, pick
    request      one request's victim chooser from an `EvictConfig` (read, never imported)
"""

from .recall import ORACLE_RECALL, OracleRecall
from .request import OracleRequest, oracle_policy

__all__ = ["ORACLE_RECALL", "OracleRecall", "OracleRequest", "oracle_policy"]
