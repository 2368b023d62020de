"""The decoding engine: `ar`, `dflash` and `ddtree` in one loop of draft -> tree -> verify -> commit.

Every emitted token is the target's own pick at the node where it is emitted (see sampling.py), so all
three methods produce the target's output: the same tokens when greedy, the same distribution when
sampling. The methods differ only in how many of those picks one target forward pays for.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from transformers import GenerationConfig

from ddtree import grammar
from ddtree.draft import DFlashDraft, DraftCache, load_draft
from ddtree.draft_vocab import DraftHead, check_draft_vocab, read_draft_vocab
from ddtree.errors import DDTreeError
from ddtree.fast import MAX_BUDGET, FastPath, unsupported
from ddtree.fast.hybrid import HybridFastPath
from ddtree.quantize import check_device, check_format, quantize_module
from ddtree.sampling import History, SamplingParams, make_generator, pick_tokens, process_logits, token_logprobs
from ddtree.target import HybridTarget, Target, load_target
from ddtree.tree import DraftTree, build_tree, chain_tree, walk

METHODS = ("ddtree", "dflash", "ar")
DEFAULT_BUDGET = 32
ASSETS = Path(__file__).parent / "assets" / "demo"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # best first
    rank: int | None = None  # the token's rank in its distribution (1: the most likely); prompt tokens only


@dataclass
class RoundOutput:
    """What one target forward (or the prefill) committed."""

    token_ids: list[int]  # emitted tokens, cut at EOS / stop id (never included) / max_new_tokens
    logprobs: list[TokenLogprob] | None
    draft_nodes: int  # tree nodes verified, root excluded
    accepted: int  # accepted draft tokens, bonus excluded (= depth of the deepest accepted node)
    phase_seconds: dict[str, float]
    finish_reason: str | None = None  # None while going on; "stop" or "length"
    stop_token_id: int | None = None
    is_prefill: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the prefill's, when asked for (first: None)


@dataclass
class GenerationStats:
    method: str
    budget: int
    block_size: int
    prompt_tokens: int
    rounds: int = 0  # verify forwards after the prefill
    generated_tokens: int = 0
    committed_tokens: int = 0  # tokens committed by verify rounds incl. bonus (before any stop cut)
    accepted_per_depth: list[int] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """τ: tokens committed per verify forward, bonus included."""
        return self.committed_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens after the prefill's, over decode time."""
        decoded = max(self.generated_tokens - 1, 0)
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def record_round(self, committed: int, phase_seconds: dict[str, float]) -> None:
        """One verify round (reference or fast path): `committed` tokens, bonus included, and its phases."""
        self.rounds += 1
        self.committed_tokens += committed
        for d in range(committed - 1):
            self.accepted_per_depth[d] += 1
        for name, seconds in phase_seconds.items():
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    def to_dict(self) -> dict:
        out = asdict(self)
        out["acceptance_length"] = round(self.acceptance_length, 4)
        out["tokens_per_second"] = round(self.tokens_per_second, 2)
        return out


PHASES = ("draft", "tree", "verify", "commit")


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    stop_token_id: int | None
    logprobs: list[TokenLogprob] | None
    stats: GenerationStats


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


class Engine:
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

    @classmethod
    def from_pretrained(cls, target: str | Path | None = None, draft: str | Path | None = None, *,
                        method: str = "ddtree", budget: int | None = None, device: str | None = None,
                        dtype: str | None = None, fast: bool | None = False, fast_capacity: int = 4096,
                        draft_vocab: str | Path | None = None, draft_quantization: str | None = None) -> Engine:
        """Load a target (and its DFlash draft); with no target, the demo pair shipped in the package.
        fast=None turns the fast path on when the model runs on CUDA (where it pays off). `draft_vocab`: a
        draft vocabulary file (ddtree.draft_vocab), the tokens the drafter may propose. `draft_quantization`:
        "fp8" runs the drafter's projections in fp8 (ddtree.quantize); None or "none" keeps its dtype."""
        if target is None:
            target, draft = ASSETS / "target", draft or ASSETS / "draft"
        if not Path(target).is_dir():
            raise DDTreeError(f"target directory {target} does not exist")
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise DDTreeError("--device cuda was asked for, but no CUDA device is available")
        torch_dtype = DTYPES[dtype] if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        fast = dev.type == "cuda" if fast is None else fast
        check_method(method, budget, has_draft=draft is not None)  # before the (slow) loading
        if draft_vocab is not None and draft is None:
            raise DDTreeError("a draft vocabulary needs a DFlash draft (--draft DIR)")
        check_draft_quantization(draft_quantization, draft is not None, dev)
        hot = read_draft_vocab(draft_vocab) if draft_vocab is not None else None
        tgt = load_target(target, device=dev, dtype=torch_dtype)
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
            if gen.on_fast_path:
                for _ in gen:
                    pass
                done.append("greedy" if params.greedy else f"temperature {params.temperature:g}")
        return done

    @property
    def max_context(self) -> int:
        return self.target.max_context

    @property
    def vocab_size(self) -> int:
        """Rows of the target's embedding: valid token ids are below this."""
        return self.target.shape.vocab_size

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise DDTreeError("the target has no tokenizer; pass token ids (--prompt-ids) instead of text")
        if chat:
            return self.chat_ids([{"role": "user", "content": text}])
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_ids(self, messages: list[dict], *, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, **template_kwargs: object) -> list[int]:
        """Prompt ids of a chat through the tokenizer's template: one rendering for the CLI and the server."""
        return list(self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False, continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt and not continue_final_message, **template_kwargs))

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, *, method: str | None = None,
               budget: int | None = None) -> Generation:
        method, budget = check_method(method or self.method, self.budget if budget is None else budget,
                                      has_draft=self.draft is not None)
        return Generation(self, list(prompt_ids), params, method, budget)

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


class Generation:
    """One request's decoding: iterate for RoundOutputs; close() stops early and frees its state."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, method: str,
                 budget: int) -> None:
        if not prompt_ids:
            raise DDTreeError("the prompt is empty")
        vocab = engine.target.shape.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise DDTreeError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= engine.max_context:
            raise DDTreeError(f"the prompt has {len(prompt_ids)} tokens; the context length is {engine.max_context}")
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        self.method, self.budget = method, budget if method == "ddtree" else 0
        depth = engine.block_size - 1
        self.stats = GenerationStats(method=method, budget=self.budget if method == "ddtree" else depth,
                                     block_size=engine.block_size, prompt_tokens=len(prompt_ids),
                                     accepted_per_depth=[0] * depth)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else engine.eos_token_ids)
        fast = engine.fast
        self.on_fast_path = fast is not None and fast.accepts(self)
        self._rounds = fast.rounds(self) if self.on_fast_path else self._run()

    def __iter__(self) -> Iterator[RoundOutput]:
        return self

    def __next__(self) -> RoundOutput:
        return next(self._rounds)

    def close(self) -> None:
        self._rounds.close()

    # -- the decoding loop -------------------------------------------------------------------------------

    @torch.inference_mode()
    def _run(self) -> Iterator[RoundOutput]:
        eng, params = self.engine, self.params
        target, draft = eng.target, eng.draft if self.method != "ar" else None
        device = target.device
        generator = make_generator(params, device)
        cache = target.new_cache()
        draft_cache = DraftCache(len(draft.layers)) if draft is not None else None
        history = History(self.prompt_ids, eng.vocab_size, device) if params.penalized else None
        constraint = eng.constraint(params)

        t0 = self._now()
        prompt = torch.tensor(self.prompt_ids, device=device)
        every_row = params.prompt_logprobs is not None
        logits, taps = target.forward(prompt, torch.arange(len(prompt), device=device), cache,
                                      logits_rows=None if every_row else 1)
        prompt_logprobs = self._prompt_logprobs(logits, params.prompt_logprobs) if every_row else None
        logits = logits[-1:]
        if constraint:
            logits = grammar.mask_logits(logits, constraint.allowed([[]]))
        processed = process_logits(logits, params, history.rows([[]]) if history else None)
        root = int(pick_tokens(processed, params, generator)[0])
        if draft is not None:
            draft.extend_context(draft_cache, taps[None], torch.arange(len(prompt), device=device)[None])
        self.stats.prefill_seconds = self._now() - t0
        start = len(prompt)  # position of the root = number of tokens in the target cache
        out = self._emit([root], self._logprob_rows(processed, [root]), 0, 0, {"prefill": self.stats.prefill_seconds},
                         True)
        out.prompt_logprobs = prompt_logprobs
        self._after_emit(out, history, constraint)
        yield out
        decode_start = self._now()
        while self.finish_reason is None:
            phases = dict.fromkeys(PHASES, 0.0)
            t = self._now()
            max_depth = min(eng.block_size - 1, eng.max_context - 1 - start)
            draft_logits = self._draft(root, start, draft_cache) if draft is not None and max_depth > 0 else None
            phases["draft"], t = self._lap(t)
            tree = self._tree(draft_logits, max_depth)
            ids = torch.tensor([root, *tree.tokens], device=device)
            positions = torch.tensor([0, *tree.depths], device=device) + start
            phases["tree"], t = self._lap(t)
            logits, taps = target.forward(ids, positions, cache, tree=tree)
            rows = None
            if history or constraint:  # each node: the emitted tokens plus its own path below the root
                pending = [[tree.tokens[j - 1] for j in tree.path_to(i)[1:]] for i in range(tree.size + 1)]
                rows = history.rows(pending) if history else None
                if constraint:
                    logits = grammar.mask_logits(logits, constraint.allowed(pending))
            processed = process_logits(logits, params, rows)
            picks = pick_tokens(processed, params, generator).tolist()
            path = walk(tree, picks)
            phases["verify"], t = self._lap(t)
            emitted = [picks[node] for node in path]
            out = self._emit(emitted, self._logprob_rows(processed[path], emitted), tree.size, len(path) - 1, phases,
                             False)
            self._after_emit(out, history, constraint)
            if self.finish_reason is None:
                target.compact(cache, start, path)
                if draft is not None:
                    path_idx = torch.tensor(path, device=device)
                    draft.extend_context(draft_cache, taps[path_idx][None], positions[path_idx][None])
                start += len(path)
                root = emitted[-1]
                if start >= eng.max_context - 1:
                    self.finish_reason = out.finish_reason = "length"
            phases["commit"], _ = self._lap(t)
            self.stats.record_round(len(path), phases)
            self.stats.decode_seconds = self._now() - decode_start
            yield out

    def _after_emit(self, out: RoundOutput, history: History | None, constraint: grammar.Constraint | None) -> None:
        """Feed the emitted tokens to the penalties' history and the grammar; a finished grammar (the output
        is whole and allows nothing more, not even EOS under ignore_eos) ends the generation."""
        if history:
            history.add(out.token_ids)
        if constraint:
            constraint.consume(out.token_ids)
            if constraint.finished and self.finish_reason is None:
                self.finish_reason = out.finish_reason = "stop"

    def _draft(self, root: int, start: int, draft_cache: DraftCache) -> torch.Tensor:
        """The drafter's logits for the next block_size - 1 positions after the root (over its draft vocabulary)."""
        eng = self.engine
        device = eng.target.device
        block = torch.full((eng.block_size,), eng.draft.config.mask_token_id, device=device)
        block[0] = root
        embeds = eng.target.embed_tokens(block)[None]
        hidden = eng.draft(embeds, torch.arange(start, start + eng.block_size, device=device)[None], cache=draft_cache)
        return eng.draft_head(hidden[0, 1:])

    def _tree(self, draft_logits: torch.Tensor | None, max_depth: int) -> DraftTree:
        if draft_logits is None:
            return DraftTree()
        draft_logits = draft_logits[:max_depth]
        head = self.engine.draft_head
        if self.method == "dflash":
            return chain_tree(head.tokens(draft_logits.argmax(dim=-1)).tolist())
        return build_tree(draft_logits, self.budget, token_ids=head.token_ids)

    def _emit(self, tokens: list[int], logprob_rows: tuple[torch.Tensor, torch.Tensor] | None, nodes: int,
              accepted: int, phases: dict[str, float], is_prefill: bool) -> RoundOutput:
        """Cut the round's tokens at the first stop id or the token limit; record what is emitted.
        `logprob_rows`: `token_logprobs` of the tokens, in order, when the request asks for logprobs."""
        kept: list[int] = []
        stop_id = None
        for token in tokens:
            if token in self._stop_ids:
                self.finish_reason, stop_id = "stop", token
                break
            kept.append(token)
            if len(self.token_ids) + len(kept) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                break
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = self._logprobs(logprob_rows, kept)
        self.token_ids.extend(kept)
        self.stats.generated_tokens = len(self.token_ids)
        return RoundOutput(kept, logprobs, nodes, accepted, phases, self.finish_reason, stop_id, is_prefill)

    def _logprob_rows(self, processed: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`token_logprobs` of the tokens emitted from processed rows [n, V], when the request asks for them."""
        if self.params.logprobs is None:
            return None
        return token_logprobs(processed, torch.tensor(tokens, device=processed.device), self.params.logprobs)

    def _logprobs(self, logprob_rows: tuple[torch.Tensor, torch.Tensor], tokens: list[int]) -> list[TokenLogprob]:
        """Target log-probs of each emitted token at its own node (after the request's processors), and the
        request's number of best alternatives (`logprob_rows` may hold more: the fast path keeps 20)."""
        if not tokens:
            return []
        values, ids = (t[:len(tokens)].tolist() for t in logprob_rows)
        k = self.params.logprobs or 0
        return [TokenLogprob(token, row[0], list(zip(top[:k], row[1:1 + k], strict=True)))
                for token, row, top in zip(tokens, values, ids, strict=True)]

    def _prompt_logprobs(self, logits: torch.Tensor, k: int, chunk: int = 512) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability under the target given the tokens before it (the raw model's,
        as vLLM reports them), its rank and the top-k alternatives; None for the first token."""
        out: list[TokenLogprob | None] = [None]
        ids = torch.tensor(self.prompt_ids[1:], device=logits.device)
        for lo in range(0, len(ids), chunk):  # [chunk, V] float32 at a time, not the whole prompt's
            logp = torch.log_softmax(logits[lo:lo + chunk][:len(ids) - lo].float(), dim=-1)
            tokens = ids[lo:lo + chunk]
            chosen = logp.gather(1, tokens[:, None])[:, 0]
            ranks = (logp > chosen[:, None]).sum(dim=-1) + 1
            top_lp, top_ids = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
            out += [TokenLogprob(t, lp, list(zip(i, v, strict=True)), r) for t, lp, r, i, v in zip(
                tokens.tolist(), chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist(), strict=True)]
        return out

    def _now(self) -> float:
        if self.engine.target.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _lap(self, t: float) -> tuple[float, float]:
        now = self._now()
        return now - t, now


def _served_name(target_dir: Path) -> str:
    """The default model id: the target directory's name, or `ddtree-demo` for the embedded pair."""
    return "ddtree-demo" if target_dir.resolve() == (ASSETS / "target").resolve() else target_dir.name


def _load_tokenizer(target_dir: Path):
    """The target's tokenizer when the checkpoint ships one (token-id-only checkpoints work without)."""
    if not any((target_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)
