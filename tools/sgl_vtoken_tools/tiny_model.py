"""A tiny Llama with a real tokenizer and chat template, generated offline and deterministically.

`python -m sgl_vtoken_tools.tiny_model DIR` (or `build_tiny_model(DIR)`) writes a Hugging Face model
folder that SGLang serves: a byte-level BPE tokenizer trained on Python standard-library sources,
a ChatML chat template, and a `LlamaForCausalLM` (GQA) with seeded random weights in fp32. Same
arguments, same bytes. The weights are random: output is gibberish, mechanics are real.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from sgl_vtoken_tools.bench.workload import at_least_one

# Standard-library sources the tokenizer is trained on, in a fixed order.
CORPUS_MODULES = (
    "argparse.py",
    "textwrap.py",
    "string.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "email/message.py",
    "http/client.py",
    "logging/__init__.py",
    "dataclasses.py",
    "functools.py",
    "collections/__init__.py",
    "pathlib.py",
    "shutil.py",
    "difflib.py",
    "pprint.py",
    "calendar.py",
    "csv.py",
)
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture of the tiny model. Defaults: 0.8M parameters, 2 layers, 4 query / 2 KV heads."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 32768
    # Larger than HF's 0.02 so that logits and attention are peaked: greedy argmax is robust to
    # float noise and attention depends on which keys are kept.
    initializer_range: float = 0.1
    seed: int = 0

    def __post_init__(self):
        at_least_one(
            self,
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("TinyModelSpec.hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "TinyModelSpec.num_attention_heads must be a multiple of num_key_value_heads"
            )
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"TinyModelSpec.vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (byte alphabet)"
            )


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in CORPUS_MODULES]


def _build_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[3],
        pad_token=SPECIAL_TOKENS[1],
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)


def _build_weights(spec: TinyModelSpec, out: Path, bos_id: int, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{k: v for k, v in asdict(spec).items() if k != "seed"},
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(out, safe_serialization=True)


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write the tiny model folder to `out_dir` (created if missing) and return its path.

    Deterministic: the same `spec` on the same Python gives the same files, byte for byte.
    Takes a few seconds on 2 CPU cores; needs no network.
    """
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(spec, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    _build_weights(
        spec, out, ids[SPECIAL_TOKENS[0]], ids[SPECIAL_TOKENS[3]], ids[SPECIAL_TOKENS[1]]
    )
    (out / "tiny_model_spec.json").write_text(
        json.dumps(asdict(spec), indent=2, sort_keys=True) + "\n"
    )
    return out


def ensure_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Build the model into `out_dir` unless a folder built from the same spec is already there."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    marker = out / "tiny_model_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out
    return build_tiny_model(out, spec)


def folder_digest(path: str | Path) -> str:
    """sha256 over the names and bytes of every file in a model folder (sorted)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            h.update(f.relative_to(path).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--layers", type=int, default=TinyModelSpec.num_hidden_layers)
    args = parser.parse_args(argv)
    out = build_tiny_model(
        args.out_dir, TinyModelSpec(seed=args.seed, num_hidden_layers=args.layers)
    )
    print(f"{out} sha256={folder_digest(out)}")


if __name__ == "__main__":
    main()
