"""Forced shortages: the chosen requests get no page of the kind their id names (every kind when
it names none) and their shortages are tallied apart. That a server's processes pick them up
from `server_env` is what the end-to-end tests that count `forced:` paths rely on."""

from types import SimpleNamespace as NS

from sgl_vtoken.patches.core.shortage import Shortages
from sgl_vtoken_tools import forced_shortage


def test_the_chosen_requests_are_refused_the_pages_their_id_names():
    alloc = forced_shortage.refusing_alloc(lambda tree, n, req, kind: list(range(n)), "shortage-")
    asks = [
        ("shortage-copies-1", "tail"),
        ("shortage-tail-1", "tail"),
        ("shortage-1", "restore"),
        ("chat-1", "copies"),
    ]
    assert [alloc(None, 4, NS(rid=rid), kind) is not None for rid, kind in asks] == [
        True,
        False,
        False,
        True,
    ]
    assert alloc(None, 4, None, "copies") == [0, 1, 2, 3]  # pages for no request


def test_their_shortages_are_tallied_apart():
    class Forced(Shortages):
        note = forced_shortage.tallying_note(Shortages.note, "shortage-")

    met = Forced()
    met.note("admission_deferred", "shortage-tail-1", "tail")
    met.note("eviction_deferred", "chat-1")
    met.note("eviction_deferred", "shortage-2")
    assert met.as_dict() == {
        "eviction_deferred": 1,
        "forced:admission_deferred:tail": 1,
        "forced:eviction_deferred": 1,
    }


def test_server_env_puts_a_sitecustomize_that_installs_it_first_on_the_path():
    env = forced_shortage.server_env("shortage-")
    assert env[forced_shortage.ENV_VAR] == "shortage-"
    site = env["PYTHONPATH"].split(":")[0]
    text = open(f"{site}/sitecustomize.py").read()
    assert "install()" in text
