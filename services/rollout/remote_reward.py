"""The `remote` verifier: a reward served over HTTP (a judge model, a sandbox, a grader
service). Each sample is one POST of JSON

    {"prompt", "response", "ground_truth", "prompt_id", "data_source", "extra"}

to `reward.remote_url`; the answer is a JSON number or an object with `score` (and other
numbers, kept as reward components). It runs on the worker's loop like any async reward, so
`reward.max_concurrency` bounds the requests in flight and `reward.timeout_s` each one; an
HTTP error or a bad body scores the fallback, counted (services/rollout/rewards.py).
"""

from __future__ import annotations

from typing import Any

from services.rollout.verifiers import RewardInput


class RemoteReward:
    """POSTs samples to `url` over one aiohttp session (opened on first use, on the loop)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._session: Any = None

    async def __call__(self, sample: RewardInput) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(raise_for_status=True)
        body = {"prompt": sample.prompt, "response": sample.response,
                "ground_truth": sample.ground_truth, "prompt_id": sample.prompt_id,
                "data_source": sample.data_source, "extra": dict(sample.extra)}
        async with self._session.post(self.url, json=body) as resp:
            return await resp.json()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
