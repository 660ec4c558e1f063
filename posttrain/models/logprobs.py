"""Per-token log-probs of whole sequences by the training passes' own code, and the run's check that those
passes are the model's own forward.

- :func:`batched_logprobs`: the old-policy and reference passes (no gradient), micro-batched as the step is,
  through :func:`posttrain.models.modeling.forward`, the function the step's loss is computed from.
- :func:`completion_logprobs`: the same for a user's own token ids (``posttrain.completion_logprobs``).
- :func:`probe_logprobs`: one sequence through the model's plain forward (what a sampler is compared with).
- :func:`check_training_path`: at the start of every run, the training passes against the model's own
  forward over each probe sequence alone, their log-probs and those log-probs' gradients. A family whose
  fast paths posttrain computes wrongly stops the run before the first step, with its name and the paths it
  took, instead of training on the log-probs, or the gradients, of another model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posttrain.models.architecture import family, head_unsupported_reason
from posttrain.models.batching import micro_batch_rows
from posttrain.models.modeling import ValueHead, collate, forward, has_packed_attention, unwrapped
from posttrain.models.compute import autocast_dtype, gradient_gap

PATH_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
"""The largest mean gap per token, in nats, between the training passes and the model's own forward that the
run's probe accepts, by the dtype the model computes in: float32 rounding in float32 (the families' tiny
models agree to about 1e-6); in bfloat16 each side rounds its own way, as a bf16 sampler does against its
trainer (``posttrain.training.guards.SYNC_TOLERANCE``)."""

GRADIENT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.25, torch.bfloat16: 0.25}
"""The largest gap between the training passes' gradients and the model's own forward's, each parameter's relative
to its own largest (:func:`posttrain.models.compute.gradient_gap`), that the run's probe accepts, by the dtype the
model computes in. The families' tiny models agree to 5e-5 in float32 and to 5e-2 under bf16 autocast, where the
two backward passes round their own ways; so in bf16 the probe catches a pass that skips a computation (a gap of
1) but not a small leak, which the float32 probe and :data:`posttrain.models.architecture.UNBATCHABLE` cover."""


@torch.no_grad()
def batched_logprobs(
    model: nn.Module,
    prompt_ids: list[Tensor],
    completion_ids: Tensor,
    mask: Tensor,
    *,
    pad_id: int,
    micro_batch_size: int,
    temperature: float = 1.0,
    value_head: ValueHead | None = None,
    present: Tensor | None = None,
    share_prompts: bool = True,
    trim_padding: bool = True,
    max_tokens_per_micro_batch: int | None = None,
    routing: Tensor | None = None,
    images: list[dict[str, Tensor]] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and values) of whole rollouts without gradient: ([N, T], [N, T] | None), 0 outside ``mask``
    (``present``, ``share_prompts``, ``trim_padding``, ``routing``, ``images``: as in
    :func:`posttrain.models.modeling.collate`;
    micro-batches as :func:`posttrain.models.batching.micro_batch_rows` makes them)."""
    device = next(model.parameters()).device
    total, width = completion_ids.shape
    logprobs = torch.zeros(total, width)
    values = torch.zeros(total, width) if value_head is not None else None
    seen = mask if present is None else present
    for rows in micro_batch_rows(prompt_ids, seen.sum(-1), rows=micro_batch_size, tokens=max_tokens_per_micro_batch,
                                 share_prompts=share_prompts):
        batch = collate([prompt_ids[int(r)] for r in rows], completion_ids[rows], mask[rows], pad_id, device,
                        None if present is None else present[rows], share_prompts=share_prompts,
                        trim_padding=trim_padding, routing=None if routing is None else routing[rows],
                        images=None if images is None else [images[int(r)] for r in rows])
        out = forward(model, batch, temperature=temperature, value_head=value_head)
        t = out.logprobs.shape[1]
        logprobs[rows, :t] = out.logprobs.float().cpu()
        if values is not None:
            values[rows, :t] = out.values.float().cpu()
    return logprobs * mask, (values * mask if values is not None else None)


def completion_logprobs(model: nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]], *,
                        share_prompts: bool = True, max_tokens_per_micro_batch: int | None = None,
                        temperature: float = 1.0, micro_batch_size: int = 64) -> list[Tensor]:
    """The per-token log-probs a training run computes for each completion after its prompt: one 1-D float32
    tensor per completion, ``len(completion)`` long (token ``t`` given the prompt and tokens ``< t``, logits
    divided by ``temperature``).

    It runs exactly the passes the training step and the reference run (:func:`batched_logprobs`): the model
    gets the packed attention where that is its own forward, completions of one prompt share its pass
    (``share_prompts``), micro-batches of ``micro_batch_size`` rows or ``max_tokens_per_micro_batch`` tokens.
    ``model`` is a transformers causal LM (LoRA-wrapped or not), as loaded: its attention implementation is
    set to its packed form, which computes what it computed for any pass that is not packed."""
    from posttrain.models.compute import use_packed_attention

    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"completion_logprobs: {len(prompt_ids)} prompts and {len(completion_ids)} completions; "
                         "give one prompt per completion (repeat a prompt for each of its completions)")
    empty = [i for i, ids in enumerate(prompt_ids) if not len(ids)]
    if empty:
        raise ValueError(f"completion_logprobs: prompt {empty[0]} is empty; a completion's first token is predicted "
                         "by its prompt's last one (start it with the model's BOS token)")
    if not completion_ids:
        return []
    use_packed_attention(model)
    width = max(max(len(ids) for ids in completion_ids), 1)
    completions = torch.zeros(len(completion_ids), width, dtype=torch.long)
    mask = torch.zeros_like(completions)
    for row, ids in enumerate(completion_ids):
        completions[row, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        mask[row, :len(ids)] = 1
    prompts = [torch.as_tensor(ids, dtype=torch.long) for ids in prompt_ids]
    logprobs, _ = batched_logprobs(model, prompts, completions, mask, pad_id=0, micro_batch_size=micro_batch_size,
                                   temperature=temperature, share_prompts=share_prompts,
                                   max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    return [logprobs[row, :len(ids)].clone() for row, ids in enumerate(completion_ids)]


@torch.no_grad()
def probe_logprobs(model: nn.Module, probe_ids: Tensor) -> Tensor:
    """[T] token ids -> [T - 1] float32 log-probs of tokens 1.. under ``model`` (a causal LM), on the CPU: what
    a sampler and the trainer compare after a weight sync (``posttrain.training.guards.SyncCheck``)."""
    ids = probe_ids.to(next(model.parameters()).device).unsqueeze(0)
    logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()


class TrainingPathError(RuntimeError):
    """The training passes' log-probs differ from the model's own forward beyond its dtype's tolerance."""


PROBE_PROMPTS = (48, 40)
PROBE_COMPLETIONS = (12, 3, 9, 6)
"""The probe: two prompts, each with four completions of these lengths; long enough that the step would share
each prompt between its completions (``posttrain.models.modeling.worth_sharing``) and that a few-token sliding
window drops keys."""


def probe_sequences(vocab_size: int, seed: int = 0, exclude: list[int] = ()) -> tuple[list[Tensor], list[Tensor]]:
    """(prompt ids, completion ids) of the probe, one prompt per completion, random ids of the vocabulary but
    ``exclude`` (a vision-language model's image tokens, which stand for images the probe does not have)."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor(sorted(set(range(vocab_size)) - set(exclude)))

    def draw(n: int) -> Tensor:
        return allowed[torch.randint(len(allowed), (n,), generator=generator)]

    prompts = [draw(n) for n in PROBE_PROMPTS]
    completions = [draw(n) for n in PROBE_COMPLETIONS * len(prompts)]
    return [p for p in prompts for _ in PROBE_COMPLETIONS], completions


def own_logprobs(model: nn.Module, prompt: Tensor, completion: Tensor, temperature: float = 1.0, *,
                 grad: bool = False) -> Tensor:
    """[len(completion)] the completion's log-probs from the model's own forward over prompt + completion alone
    (no padding, no layout, its own head); with their graph when ``grad``."""
    from posttrain.models.vision import causal_text_inputs

    ids = torch.cat([prompt, completion])[None].to(next(model.parameters()).device)
    with torch.set_grad_enabled(grad):  # no cache: one pass needs none (nor can a RecurrentGemma build one without
        logits = model(input_ids=ids, use_cache=False,  # attention layers)
                       **causal_text_inputs(model, ids)).logits[0, len(prompt) - 1:-1].float() / temperature
        return logits.log_softmax(-1).gather(-1, completion.to(logits.device)[:, None])[:, 0].cpu()


def paths_taken(model: nn.Module, *, share_prompts: bool, trim_padding: bool) -> str:
    """The training passes ``model`` takes, in words, for messages."""
    if getattr(unwrapped(model).config, "vision_config", None) is not None:
        return "padded rows with their images, the model's own forward"
    packed = trim_padding and has_packed_attention(unwrapped(model))
    rows = ("packed rows" + (", a prompt shared by its completions" if share_prompts else "")) if packed else \
        ("rows grouped by length" if trim_padding else "padded rows")
    head = "the folded LM head" if head_unsupported_reason(model) is None else "the model's own LM head"
    return f"{rows}, {head}"


def check_training_path(model: nn.Module, vocab_size: int, *, share_prompts: bool = True, trim_padding: bool = True,
                        max_tokens_per_micro_batch: int | None = None, micro_batch_size: int = 64) -> float:
    """The mean gap per token between the training passes (:func:`batched_logprobs` with the run's settings) and
    the model's own forward over each probe sequence alone; :class:`TrainingPathError` beyond
    :data:`PATH_TOLERANCE`, or where their gradients part beyond :data:`GRADIENT_TOLERANCE` (a pass can give the
    model's log-probs and not their gradients: RecurrentGemma's padded rows), naming the family and the paths, and
    what to run instead (padded rows, when they are the model's own: measured too before it says so)."""
    settings = dict(max_tokens_per_micro_batch=max_tokens_per_micro_batch, micro_batch_size=micro_batch_size)
    dtype = autocast_dtype(model) or next(p for p in model.parameters()).dtype
    tolerance = PATH_TOLERANCE.get(dtype, PATH_TOLERANCE[torch.float16])
    grad_tolerance = GRADIENT_TOLERANCE.get(dtype, GRADIENT_TOLERANCE[torch.float16])

    def wrong(gaps: tuple[float, float]) -> str | None:  # what is wrong with a path's (log-prob, gradient) gaps
        if not gaps[0] <= tolerance:
            return f"log-probs {gaps[0]:.3g} nats per token"
        if not gaps[1] <= grad_tolerance:
            return f"the same log-probs, but gradients {gaps[1]:.3g} apart (each parameter's, relative to its own)"
        return None

    gaps = _path_gaps(model, vocab_size, share_prompts=share_prompts, trim_padding=trim_padding, **settings)
    if wrong(gaps) is None:
        return gaps[0]
    taken = paths_taken(model, share_prompts=share_prompts, trim_padding=trim_padding)
    what = (f"the training passes of {family(model)} ({taken}) give {wrong(gaps)} from the model's own forward over "
            f"each sequence alone (tolerances {tolerance:g} and {grad_tolerance:g} in "
            f"{str(dtype).removeprefix('torch.')}): training would follow another model")
    if trim_padding or share_prompts:
        padded = _path_gaps(model, vocab_size, share_prompts=False, trim_padding=False, **settings)
        if wrong(padded) is None:
            raise TrainingPathError(f"{what}. Train with --no-trim-padding --no-share-prompts (padded rows through the "
                                    f"model's own forward, {padded[0]:.1g} nats per token apart), and report the "
                                    "family to posttrain")
        what += f"; padded rows give {wrong(padded)}"
    raise TrainingPathError(f"{what}. Even its padded rows are not the model alone: its forward depends on the other "
                            "rows of its batch or on their padding, which posttrain cannot train exactly")


def _path_gaps(model: nn.Module, vocab_size: int, *, share_prompts: bool, trim_padding: bool,
               **settings) -> tuple[float, float]:
    """Over the probe sequences (prompts of different lengths, so a batch pads them): the mean gap per token between
    :func:`batched_logprobs` with these settings and the model's own forward, and the gap between the gradients of
    the two's summed log-probs with respect to the trainable parameters (:func:`gradient_gap`; the passes as one
    micro-batch). Holds two gradients of the trainable parameters for a moment: less than an optimizer step's
    state, which does not exist yet."""
    from posttrain.models.vision import image_token_ids, is_vision_model

    prompts, completions = probe_sequences(vocab_size, exclude=image_token_ids(model) if is_vision_model(model) else [])
    width = max(len(c) for c in completions)
    completion_ids = torch.zeros(len(completions), width, dtype=torch.long)
    mask = torch.zeros_like(completion_ids)
    for row, ids in enumerate(completions):
        completion_ids[row, :len(ids)], mask[row, :len(ids)] = ids, 1
    params = [p for p in model.parameters() if p.requires_grad]
    was_training = model.training
    model.eval()  # dropout would make the two sides differ by chance
    try:
        trained, _ = batched_logprobs(model, prompts, completion_ids, mask, pad_id=0, share_prompts=share_prompts,
                                      trim_padding=trim_padding, **settings)
        with torch.enable_grad():
            own = [own_logprobs(model, p, c, grad=bool(params)) for p, c in zip(prompts, completions)]
            grad_gap = 0.0
            if params:  # the own forwards' graphs are freed before the training pass builds its own
                theirs = torch.autograd.grad(sum(o.sum() for o in own), params, allow_unused=True)
                batch = collate(prompts, completion_ids, mask, 0, next(model.parameters()).device,
                                share_prompts=share_prompts, trim_padding=trim_padding)
                mine = torch.autograd.grad(forward(model, batch).logprobs.float().sum(), params, allow_unused=True)
                grad_gap = gradient_gap(mine, theirs)
                del mine, theirs
    finally:
        model.train(was_training)
    gaps = [(trained[row, :len(c)] - o.detach()).abs() for row, (c, o) in enumerate(zip(completions, own))]
    return float(torch.cat(gaps).mean()), grad_gap


def check_causal(model: nn.Module, vocab_size: int) -> None:
    """A ConfigError unless ``model`` is causal: a position's logits must not change when a later token does (an
    encoder's bidirectional attention, loaded through a causal LM head, would train on the future)."""
    from posttrain.config import ConfigError
    from posttrain.models.vision import causal_text_inputs, image_token_ids, is_vision_model

    ids, changed = probe_sequences(vocab_size, seed=1, exclude=image_token_ids(model) if is_vision_model(model) else [])
    ids = ids[0][:16]
    changed = torch.cat([ids[:12], changed[0][:4]])  # the same first 12 tokens, later ones drawn again
    if torch.equal(ids, changed):
        changed[12:] = ids[12:].roll(1)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # dropout (GPT-2's config has 0.1) would change the logits by chance
    try:
        with torch.no_grad():  # the same shapes, the same first 12 tokens: a causal model's logits there are the same
            logits = [model(input_ids=x[None].to(device), use_cache=False,
                            **causal_text_inputs(model, x[None].to(device))).logits[0, :12].float()
                      for x in (ids, changed)]
    finally:
        model.train(was_training)
    if not torch.allclose(*logits, rtol=1e-5, atol=1e-5):
        raise ConfigError(f"model: {family(model)} is not causal: its predictions for earlier positions change when a "
                          "later token does (a bidirectional encoder); posttrain trains decoder-only causal LMs")
