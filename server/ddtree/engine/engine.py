"""The engine: a target, an optional DFlash drafter and their tokenizer, and the backends that decode with them.

Every emitted token is the target's own pick at the node where it is emitted (see core/sampling.py), so all
three methods produce the target's output: the same tokens when greedy, the same distribution when
sampling. The methods differ only in how many of those picks one target forward pays for.

A request is a `Generation` (generation.py: the one loop) over a backend: the fast path (ddtree.fast) when it
takes the request, else the reference path (reference.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import GenerationConfig

from ddtree.core import grammar
from ddtree.core.rounds import Backend, DecodeRequest
from ddtree.core.sampling import SamplingParams
from ddtree.engine.batch import BatchEngine, BatchOptions, batch_engine
from ddtree.engine.generation import Generation, GenerationResult, TokenLogprob
from ddtree.engine.reference import ReferenceBackend
from ddtree.engine.text import TextCodec
from ddtree.errors import DDTreeError
from ddtree.fast.hybrid import HybridFastPath
from ddtree.fast.runner import MAX_BUDGET, FastPath
from ddtree.fast.support import unsupported
from ddtree.models.draft import DFlashDraft, load_draft
from ddtree.models.draft_vocab import DraftHead, check_draft_vocab, read_draft_vocab
from ddtree.models.quantize import check_device, check_format, quantize_module
from ddtree.models.shapes import ShapeTokenizer, build_models, check_shape
from ddtree.models.target import HybridTarget, Target, load_target

METHODS = ("ddtree", "dflash", "ar")
DEFAULT_BUDGET = 32
ASSETS = Path(__file__).parents[1] / "assets" / "demo"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_method(method: str, budget: int | None, *, has_draft: bool) -> tuple[str, int]:
    """Validate a decoding method and budget (default budget filled in); one-line errors."""
    if method not in METHODS:
        raise DDTreeError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method != "ar" and not has_draft:
        raise DDTreeError(f"method {method} needs a DFlash draft (--draft DIR), or use --method ar")
    budget = DEFAULT_BUDGET if budget is None else budget
    if budget < 0:
        raise DDTreeError(f"budget must be >= 0, got {budget}")
    return method, budget


def check_draft_quantization(quantization: str | None, has_draft: bool, device: torch.device) -> str | None:
    """The draft quantization format (None for none), or a one-line error: it needs a draft, and on CUDA a GPU
    with fp8 tensor cores."""
    quantization = check_format(quantization)
    if quantization is not None:
        if not has_draft:
            raise DDTreeError("draft quantization needs a DFlash draft (--draft DIR)")
        check_device(device)
    return quantization


def generation_defaults(config: GenerationConfig | None) -> dict[str, float]:
    """The sampling values the target's generation_config.json sets (Qwen3: temperature 0.6, top_p 0.95,
    top_k 20), for requests that leave them out, as vLLM's `--generation-config auto` applies them.

    Only keys the file itself names: transformers 5 leaves the others None, so `to_diff_dict` holds exactly
    those. `do_sample` is ignored, as vLLM ignores it, so a checkpoint samples the same behind either server.
    Checked here so that a bad value stops loading instead of failing every request.
    """
    given = config.to_diff_dict() if config is not None else {}
    try:
        defaults = {k: int(given[k]) if k == "top_k" else float(given[k])
                    for k in GENERATION_KEYS if given.get(k) is not None}
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise DDTreeError(f"the target's generation_config.json has an invalid sampling value: {exc}") from None
    return defaults


class Engine(TextCodec):
    """A target, an optional drafter and their tokenizer, decoding one sequence at a time."""

    def __init__(self, target: Target, draft: DFlashDraft | None, tokenizer=None, *, method: str = "ddtree",
                 budget: int | None = None, model_name: str = "ddtree", fast: bool = False,
                 fast_capacity: int = 4096, draft_vocab: Sequence[int] | DraftHead | None = None,
                 draft_quantization: str | None = None) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.method, self.budget = check_method(method, budget, has_draft=draft is not None)
        self.block_size = draft.config.block_size if draft is not None else 1
        eos = set()
        for source in (target.config, getattr(target.model, "generation_config", None), tokenizer):
            value = getattr(source, "eos_token_id", None)
            eos.update(value if isinstance(value, (list, tuple, set)) else [value] if value is not None else [])
        self.eos_token_ids: set[int] = eos
        self.generation_defaults = generation_defaults(getattr(target.model, "generation_config", None))
        # fp8 drafter projections (ddtree.quantize): the draft module is quantized in place, once.
        self.draft_quantization = check_draft_quantization(draft_quantization, draft is not None, target.device)
        if self.draft_quantization is not None:
            quantize_module(draft)
        # What the drafter scores its block with: the target's LM head, or its rows of a draft vocabulary (a
        # DraftHead is shared as it is: two engines over one pair need not copy the rows twice).
        self.draft_head: DraftHead | None = None
        if draft is not None:
            shared = isinstance(draft_vocab, DraftHead)
            self.draft_head = (draft_vocab if shared
                               else DraftHead(target.lm_head, draft_vocab, self.draft_quantization))
            target.set_taps(draft.config.target_layer_ids)
        # The fast path (ddtree.fast) takes the requests it can serve; the others, and all when off, run _run.
        self.fast_unsupported = unsupported(target) if fast else "off"
        fast_path = HybridFastPath if isinstance(target, HybridTarget) else FastPath
        self.fast = fast_path(target, draft, fast_capacity, self.draft_head) if self.fast_unsupported is None else None
        self.reference = ReferenceBackend(target, draft, self.draft_head)

    @classmethod
    def from_pretrained(cls, target: str | Path | None = None, draft: str | Path | None = None, *,
                        method: str = "ddtree", budget: int | None = None, device: str | None = None,
                        dtype: str | None = None, fast: bool | None = False, fast_capacity: int = 4096,
                        draft_vocab: str | Path | None = None, draft_quantization: str | None = None,
                        quantization: str | None = None) -> Engine:
        """Load a target (and its DFlash draft); with no target, the demo pair shipped in the package.
        fast=None turns the fast path on when the model runs on CUDA (where it pays off). `draft_vocab`: a
        draft vocabulary file (ddtree.draft_vocab), the tokens the drafter may propose. `draft_quantization`:
        "fp8" runs the drafter's projections in fp8 (ddtree.quantize); None or "none" keeps its dtype.
        `quantization`: "fp8" quantizes a bf16 target's projections on load (an FP8 checkpoint is fp8 as it is:
        ddtree/models/fp8_target.py)."""
        if target is None:
            target, draft = ASSETS / "target", draft or ASSETS / "draft"
        if not Path(target).is_dir():
            raise DDTreeError(f"target directory {target} does not exist")
        dev, torch_dtype = placement(device, dtype)
        fast = dev.type == "cuda" if fast is None else fast
        check_method(method, budget, has_draft=draft is not None)  # before the (slow) loading
        if draft_vocab is not None and draft is None:
            raise DDTreeError("a draft vocabulary needs a DFlash draft (--draft DIR)")
        check_draft_quantization(draft_quantization, draft is not None, dev)
        hot = read_draft_vocab(draft_vocab) if draft_vocab is not None else None
        tgt = load_target(target, device=dev, dtype=torch_dtype, quantization=quantization)
        tokenizer = _load_tokenizer(Path(target))
        drf = None
        if draft is not None:
            mask_from_tok = None
            if tokenizer is not None:
                mask_from_tok = tokenizer.convert_tokens_to_ids("<|MASK|>")
                mask_from_tok = None if mask_from_tok == tokenizer.unk_token_id else mask_from_tok
            drf = load_draft(draft, tgt.shape, device=dev, dtype=torch_dtype,
                             mask_token_from_tokenizer=mask_from_tok)
        if hot is not None:
            hot = check_draft_vocab(*hot, tgt.shape.vocab_size, draft_vocab)
        return cls(tgt, drf, tokenizer, method=method, budget=budget, model_name=_served_name(Path(target)),
                   fast=fast, fast_capacity=fast_capacity, draft_vocab=hot, draft_quantization=draft_quantization)

    @classmethod
    def from_shape(cls, name: str, *, method: str = "ddtree", budget: int | None = None, device: str | None = None,
                   dtype: str | None = None, fast: bool | None = False, fast_capacity: int = 4096,
                   draft_vocab: str | Path | None = None, draft_quantization: str | None = None,
                   quantization: str | None = None) -> Engine:
        """A random-weight target and DFlash drafter of a published shape (models/shapes.py), seeded, with the demo
        pair's tokenizer: a server measured at a model's size without its checkpoint (vLLM's `--load-format
        dummy`). Its replies are noise; ids beyond the tokenizer decode as others (`ShapeTokenizer`)."""
        vocab = check_shape(name)["target"]["vocab_size"]
        dev, torch_dtype = placement(device, dtype)
        fast = dev.type == "cuda" if fast is None else fast
        check_method(method, budget, has_draft=True)
        check_draft_quantization(draft_quantization, True, dev)
        hot = read_draft_vocab(draft_vocab) if draft_vocab is not None else None
        tokenizer = _load_tokenizer(ASSETS / "target")
        if vocab < len(tokenizer):
            raise DDTreeError(f"shape {name} has {vocab} tokens, fewer than the demo tokenizer's {len(tokenizer)}")
        if vocab > len(tokenizer):
            tokenizer = ShapeTokenizer(tokenizer)
        target, draft = build_models(name, dev, torch_dtype, quantization)
        if hot is not None:
            hot = check_draft_vocab(*hot, vocab, draft_vocab)
        return cls(target, draft, tokenizer, method=method, budget=budget, model_name=name, fast=fast,
                   fast_capacity=fast_capacity, draft_vocab=hot, draft_quantization=draft_quantization)

    @functools.cached_property
    def grammar_tokenizer(self) -> object:
        """The tokenizer as the structured-output constraint reads it, built on first use."""
        return grammar.grammar_tokenizer(self.tokenizer, self.vocab_size)

    def constraint(self, params: SamplingParams) -> grammar.Constraint | None:
        """A fresh grammar state for one generation under `params.grammar` (None without one)."""
        if params.grammar is None:
            return None
        return grammar.Constraint(self.grammar_tokenizer, params.grammar, self.vocab_size, params.think)

    @property
    def fast_note(self) -> str | None:
        """Why requests at this engine's own method and budget will take the reference path although the fast
        path is on (None when they will not). Worth saying once at startup: on a GPU it costs several times."""
        if self.fast is not None and self.method == "ddtree" and self.budget > MAX_BUDGET:
            return (f"budget {self.budget} is above the fast path's largest tree ({MAX_BUDGET} nodes): ddtree "
                    "requests take the reference path, several times slower on a GPU")
        return None

    def warm_up(self, *settings: SamplingParams) -> list[str]:
        """Run one short generation per sampling setting at the engine's own method and budget, so that the
        fast path captures its CUDA graphs and compiles its kernels now, not while the first requests wait.
        Returns what was warmed up; nothing without a fast path. The generations leave no state behind:
        every request starts with its own prefill."""
        done = []
        if self.fast is None:
            return done
        prompt = [i % self.vocab_size for i in range(1, 9)]
        for params in settings:
            gen = self.stream(prompt, replace(params, max_new_tokens=2 * self.block_size, ignore_eos=True))
            if gen.backend is self.fast:
                for _ in gen:
                    pass
                done.append("greedy" if params.greedy else f"temperature {params.temperature:g}")
        return done

    def batch(self, options: BatchOptions | None = None) -> BatchEngine:
        """A batch engine over this engine's models: many requests decoded together (engine/batch.py)."""
        return batch_engine(self, options or BatchOptions())

    @property
    def max_context(self) -> int:
        return self.target.max_context

    @property
    def vocab_size(self) -> int:
        """Rows of the target's embedding: valid token ids are below this."""
        return self.target.shape.vocab_size

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, *, method: str | None = None,
               budget: int | None = None) -> Generation:
        """A generation of `prompt_ids` (iterate it for its rounds' outputs), on the fast path when it takes it."""
        request = self.request(prompt_ids, params, method=method, budget=budget)
        backend = self.fast if self.fast is not None and self.fast.accepts(request) else self.reference
        return self.generation(request, backend)

    def request(self, prompt_ids: Sequence[int], params: SamplingParams, *, method: str | None = None,
                budget: int | None = None) -> DecodeRequest:
        """A request as a backend decodes it, checked (one-line errors); the engine's method and budget by default."""
        method, budget = check_method(method or self.method, self.budget if budget is None else budget,
                                      has_draft=self.draft is not None)
        return DecodeRequest(self.check_prompt(prompt_ids), params, method, budget if method == "ddtree" else 0,
                             self.constraint(params))

    def generation(self, request: DecodeRequest, backend: Backend | None) -> Generation:
        """The request's loop, pulling its rounds from `backend`, or fed by a batch engine (None)."""
        return Generation(request, backend, block_size=self.block_size, max_context=self.max_context,
                          eos_token_ids=self.eos_token_ids)

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt as a list, or a one-line error: empty, ids outside the vocabulary, or no room to generate."""
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise DDTreeError("the prompt is empty")
        vocab = self.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise DDTreeError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_context:
            raise DDTreeError(f"the prompt has {len(prompt_ids)} tokens; the context length is {self.max_context}")
        return prompt_ids

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, method: str | None = None,
                 budget: int | None = None) -> GenerationResult:
        gen = self.stream(prompt_ids, params, method=method, budget=budget)
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        stop_id = None
        for out in gen:
            if logprobs is not None and out.logprobs:
                logprobs.extend(out.logprobs)
            stop_id = out.stop_token_id if out.stop_token_id is not None else stop_id
        return GenerationResult(gen.token_ids, gen.finish_reason or "length", stop_id, logprobs, gen.stats)


def placement(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """The device asked for (cuda when there is one) and the weights' dtype (bfloat16 on cuda, else float32)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DDTreeError("--device cuda was asked for, but no CUDA device is available")
    return dev, DTYPES[dtype] if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def _served_name(target_dir: Path) -> str:
    """The default model id: the target directory's name, or `ddtree-demo` for the embedded pair."""
    return "ddtree-demo" if target_dir.resolve() == (ASSETS / "target").resolve() else target_dir.name


def _load_tokenizer(target_dir: Path):
    """The target's tokenizer when the checkpoint ships one (token-id-only checkpoints work without)."""
    if not any((target_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)
