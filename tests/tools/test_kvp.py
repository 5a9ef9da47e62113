"""KVP scorer, checkpoint identity, ranking objective and training, and the `kvp` policy."""

import pytest
import torch

from sgl_vtoken.config import EvictConfig, policy_from_config
from sgl_vtoken.kvp import KVPScorer, ModelIdentity, load_checkpoint, load_scorer, save_checkpoint
from sgl_vtoken.policies import make_policy
from sgl_vtoken.types import TokenView
from sgl_vtoken_tools.kvp_train import Traces, evaluate, normalized_reward, ranking_loss, train

IDT = ModelIdentity("llama", num_layers=2, num_kv_heads=2, head_dim=8)


def rand_kv(n, seed=0, idt=IDT):
    g = torch.Generator().manual_seed(seed)
    shape = (n, idt.num_layers, idt.num_kv_heads, idt.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def synthetic_traces(seqs=12, T=48, seed=0) -> Traces:
    """Future mass known in closed form: exp(2 * key[..., 0]) for every token before the cut."""
    k, v = rand_kv(seqs * T, seed)
    k, v = k.view(seqs, T, *k.shape[1:]), v.view(seqs, T, *v.shape[1:])
    cuts = torch.tensor([24, 36, 48])
    targets = torch.zeros(seqs, len(cuts), T, IDT.num_layers, IDT.num_kv_heads)
    for c, t in enumerate(cuts.tolist()):
        targets[:, c, :t] = torch.exp(2 * k[:, :t, ..., 0])
    return Traces(IDT, k.half(), v.half(), torch.arange(T), cuts, targets, horizon=8, meta={})


def test_scorer_shapes_and_layout_check():
    k, v = rand_kv(10)
    s = KVPScorer(IDT, hidden=4)(k, v, torch.arange(10))
    assert s.shape == (10, 2, 2) and s.dtype == torch.float32
    with pytest.raises(ValueError, match=r"got keys of shape \(10, 2, 2, 4\)"):
        KVPScorer(IDT)(k[..., :4], v, torch.arange(10))


def test_checkpoint_round_trip_is_byte_identical(tmp_path):
    a = save_checkpoint(KVPScorer(IDT, hidden=4, seed=3), tmp_path / "a.safetensors")
    b = save_checkpoint(KVPScorer(IDT, hidden=4, seed=3), tmp_path / "b.safetensors")
    assert a.read_bytes() == b.read_bytes()
    loaded = load_checkpoint(a)
    k, v = rand_kv(7)
    assert loaded.identity == IDT and loaded.hidden == 4
    assert torch.equal(
        loaded(k, v, torch.arange(7)), KVPScorer(IDT, hidden=4, seed=3)(k, v, torch.arange(7))
    )
    assert load_scorer(a) is load_scorer(a)  # loaded once per process


def test_identity_mismatch_names_the_fields():
    served = ModelIdentity.from_hf_config(
        {
            "model_type": "llama",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_size": 32,
        }
    )
    assert served.head_dim == 8
    with pytest.raises(ValueError, match=r"another model \(num_layers: checkpoint 2, model 4\)"):
        IDT.check(served)
    IDT.check(IDT)


def test_loading_for_an_expected_model_checks_the_identity(tmp_path):
    path = save_checkpoint(KVPScorer(IDT, hidden=4), tmp_path / "a.safetensors")
    assert load_checkpoint(path, expect=IDT).identity == IDT
    other = ModelIdentity("qwen2", num_layers=2, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"model_type: checkpoint 'llama', model 'qwen2'"):
        load_checkpoint(path, expect=other)


@pytest.mark.parametrize(
    "content,needle",
    [
        (None, "no such file"),
        (b"not a safetensors file", "not a readable safetensors file"),
    ],
)
def test_bad_checkpoint_files_name_the_path(tmp_path, content, needle):
    path = tmp_path / "bad.safetensors"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=needle) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


def test_foreign_safetensors_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="format None, expected 'sgl-vtoken-kvp/1'"):
        load_checkpoint(tmp_path / "other.safetensors")


def test_policy_config_requires_a_readable_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="KVP.checkpoint is required"):
        make_policy("kvp")
    with pytest.raises(
        ValueError, match=r"do not fit policy 'kvp'.*KVP checkpoint '.*missing.st': no such file"
    ):
        policy_from_config(
            EvictConfig(
                policy="kvp", budget=16, params={"checkpoint": str(tmp_path / "missing.st")}
            )
        )


def test_policy_keeps_highest_scores_plus_sinks_and_window(tmp_path):
    """A hand-set scorer whose output is relu(key[..., 0]) for every head: the kept tokens are the
    sinks, the window and the largest key[..., 0]."""
    sc = KVPScorer(IDT, hidden=1)
    with torch.no_grad():
        sc.w1.zero_()
        sc.w1[:, 0, 0] = 1.0
        sc.w2.fill_(1.0)
    path = save_checkpoint(sc, tmp_path / "hand.safetensors")
    k, v = rand_kv(12, seed=1)
    k[..., 0] = 0.0
    k[[5, 8], :, :, 0] = 3.0
    view = TokenView(positions=torch.arange(12), keys=k, values=v)
    keep = make_policy("kvp", checkpoint=str(path), sink=2, window=1).keep(view, 5)
    assert keep.tolist() == [0, 1, 5, 8, 11]


def test_normalized_reward_is_zero_for_the_oracle_and_minus_one_for_the_reverse():
    m = torch.tensor([0.1, 3.0, 0.5, 2.0])
    oracle = m.sort(descending=True).values
    assert float(normalized_reward(oracle, m)) == 0.0
    assert float(normalized_reward(oracle.flip(0), m)) == -1.0


def test_ranking_loss_is_a_score_function_gradient():
    """Raising the score of the token with the most mass lowers the loss on average."""
    mass = torch.tensor([[0.0, 5.0, 0.0, 0.0]])
    scores = torch.zeros(1, 4, requires_grad=True)
    loss, reward = ranking_loss(scores, mass, num_samples=256, gen=torch.Generator().manual_seed(0))
    loss.backward()
    assert -1.0 <= float(reward) <= 0.0
    assert scores.grad[0, 1] < 0 and (scores.grad[0, [0, 2, 3]] > 0).all()


def test_training_learns_a_known_ranking_and_is_reproducible(tmp_path):
    tr = synthetic_traces()
    runs = []
    for name in ("a", "b"):
        sc = KVPScorer(IDT, hidden=16, seed=0)
        history = train(sc, tr, steps=60, seed=5, lr=1e-2, sink=4)
        runs.append(
            (save_checkpoint(sc, tmp_path / f"{name}.safetensors").read_bytes(), sc, history)
        )
    assert runs[0][0] == runs[1][0]  # same seed, same bytes
    untrained = KVPScorer(IDT, hidden=16, seed=0)
    from sgl_vtoken_tools.kvp_train import fit_feature_stats

    fit_feature_stats(untrained, tr, 4)
    before, after = evaluate(untrained, tr, 4), evaluate(runs[0][1], tr, 4)
    assert before < -0.3 and after > -0.1, (before, after)
    first = sum(h["reward"] for h in runs[0][2][:10]) / 10
    last = sum(h["reward"] for h in runs[0][2][-10:]) / 10
    assert last > first + 0.2


def test_traces_round_trip(tmp_path):
    tr = synthetic_traces(seqs=2, T=48)
    tr.save(tmp_path / "t.pt")
    back = Traces.load(tmp_path / "t.pt")
    assert (
        back.identity == IDT
        and torch.equal(back.keys, tr.keys)
        and torch.equal(back.targets, tr.targets)
    )
    with pytest.raises(ValueError, match="KVP traces is for another model"):
        train(KVPScorer(ModelIdentity("llama", 3, 2, 8)), tr, steps=1)


def test_heuristic_rankings_are_scored_like_the_scorer():
    """On the synthetic traces the mass follows key[..., 0], not recency: recency ranks like chance."""
    tr = synthetic_traces()
    sc = KVPScorer(IDT)
    assert -0.7 < evaluate(sc, tr, 4, rank_by="recency") < -0.3
    assert -1.0 <= evaluate(sc, tr, 4, rank_by="knorm") <= 0.0
    with pytest.raises(ValueError, match="rank_by must be"):
        evaluate(sc, tr, 4, rank_by="lru")
