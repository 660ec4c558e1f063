"""A verifiers taskset (verifiers 0.4, its v1 API): sums of two numbers, rewarded for the right answer.

Installed as verifiers environments are (``pip install -e examples/verifiers_sums``), it loads by name:
``--environment verifiers:my-sums``.
"""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        return [SumTask(SumData(prompt=f"What is {a} + {b}? Answer with the number.", answer=str(a + b)),
                        self.config.task)
                for a in range(10, 30) for b in range(10, 20)]


__all__ = ["SumTaskset"]
