"""The docs run: every ```python block of README.md and docs/*.md, and every relative link.

Each block runs in a fresh namespace, as if pasted into a new Python session,
so blocks never rely on one another. Its line numbers are those of the
Markdown file, so a traceback points at the failing line of the doc. A block
that cannot run here (a GPU, a real model, minutes of training) is marked
`<!-- not run: why -->` on the line above its fence and listed in NOT_RUN.

docs/functional.md's loop is also held to its claim: with the step's
normaliser, its micro-batch gradients add up to one call on the whole step.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import posttrain.functional as F

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN_MARK = re.compile(r"<!-- not run: (.+?) -->")

NOT_RUN: dict[str, str] = {}
"""Blocks shown but not run: id -> the reason their `<!-- not run: ... -->` mark gives."""


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the reason of a `<!-- not run: ... -->` mark right above the fence

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, fence = [], None
    for index, line in enumerate(lines):
        if fence is None and line.strip() == "```python":
            fence = index
        elif fence is not None and line.startswith("```"):
            mark = NOT_RUN_MARK.fullmatch(lines[fence - 1].strip()) if fence > 0 else None
            blocks.append(Block(str(path.relative_to(ROOT)), fence + 1, "\n".join(lines[fence + 1:index]) + "\n",
                                mark and mark.group(1)))
            fence = None
    return blocks


BLOCKS = [block for path in DOCS for block in python_blocks(path)]


@functools.cache
def run(block: Block) -> tuple[dict, list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]]]:
    """Executes a block once per test process; returns its namespace and, for each optimizer step
    it took, (parameter, its value, its gradient) just before the update."""
    steps = []

    def record(optimizer, args, kwargs) -> None:
        steps.append([(p, p.detach().clone(), None if p.grad is None else p.grad.clone())
                      for group in optimizer.param_groups for p in group["params"]])

    # Leading newlines give the code its line numbers in the Markdown file.
    code = compile("\n" * block.line + block.code, str(ROOT / block.path), "exec")
    namespace = {"__name__": "__main__"}
    hook = register_optimizer_step_pre_hook(record)
    try:
        with torch.random.fork_rng():  # a fixed seed for reproducible failures, without leaking it
            torch.manual_seed(0)
            exec(code, namespace)
    finally:
        hook.remove()
    return namespace, steps


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_block_runs(block: Block):
    if block.not_run:
        pytest.skip(f"marked not run: {block.not_run}")
    run(block)


def test_not_run_blocks_are_listed():
    """A skip is visible here, not only in the Markdown source."""
    assert {block.id: block.not_run for block in BLOCKS if block.not_run} == NOT_RUN


def test_functional_loop_micro_batches_give_the_whole_step_gradient():
    [block] = [b for b in BLOCKS if b.path == "docs/functional.md" and "normalizer=normalizer" in b.code]
    namespace, steps = run(block)
    assert len(steps) == len(namespace["loader"])
    policy, tokens, mask = namespace["policy"], namespace["tokens"], namespace["mask"]
    assert namespace["micro_batch_size"] < len(tokens), "one micro-batch would show nothing"

    # The namespace holds the last step's batch: take its gradient again, in one call, at the
    # weights the step saw, with the call's own normaliser (normalizer=None).
    last_step = steps[-1]
    with torch.no_grad():
        for parameter, weight, _ in last_step:
            parameter.copy_(weight)
    policy.zero_grad()
    loss, _ = F.policy_loss(namespace["logprobs"](policy, tokens), namespace["old_logp"], namespace["adv"], mask,
                            eps_low=0.2, eps_high=0.28, aggregation="token_mean",
                            ref_logprobs=namespace["ref_logp"], kl_coef=0.04)
    loss.backward()
    for parameter, _, accumulated in last_step:
        torch.testing.assert_close(accumulated, parameter.grad, rtol=1e-5, atol=1e-7)
    assert any(grad.abs().sum() > 0 for _, _, grad in last_step)


FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")  # the target of [text](target) and ![alt](target)
EXTERNAL = re.compile(r"[a-z][a-z0-9+.-]*:|#")  # https:, mailto:, or an anchor in the same file


@pytest.mark.parametrize("path", DOCS, ids=[str(path.relative_to(ROOT)) for path in DOCS])
def test_relative_links_point_to_files(path: Path):
    targets = LINK.findall(FENCED.sub("", path.read_text()))  # code blocks hold code, not links
    missing = [t for t in targets if not EXTERNAL.match(t) and not (path.parent / t.split("#")[0]).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to files that do not exist: {missing}"
