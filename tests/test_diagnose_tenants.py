"""``diagnose`` names ``noisy_neighbour`` (analyze/noisy_neighbour.py) when one tenant's load
explains another tenant's tail, on runs of the discrete-event simulator (diagnose_sim.py) whose
requests are labelled with tenants the way the server's timing labels them."""

from __future__ import annotations

from typing import Any

import numpy as np

from diagnose_sim import Sim, simulate
from tailserve.analyze.data import run_from_result
from tailserve.analyze.diagnose import diagnose


def _flood(i: int, rng: np.random.Generator) -> int:
    # Seven requests in ten are the flood's 1,000-token prompts; the rest 32-token ones.
    return 1000 if i % 10 < 7 else 32


def labelled(result: dict[str, Any], tenant_of: Any) -> dict[str, Any]:
    """The run with each request's tenant in its server timing (``tailserve_timing.tenant``)."""
    for q in result["tailserve"]["requests"]:
        q["server_timing"]["tenant"] = tenant_of(q)
    return result


def shares(d: Any, metric: str) -> dict[str, float]:
    return {c.cause: round(c.share, 3) for c in d.tails[metric].causes}


def test_a_flooding_tenant_is_named_the_noisy_neighbour_of_the_other() -> None:
    result = labelled(simulate(Sim(n=300, rate=12, prompt=_flood, per_prefill_s=0.0002,
                                   max_num_seqs=4, seed=11)),
                      lambda q: "flood" if q["prompt_len"] == 1000 else "quiet")
    d = diagnose(run_from_result(result))
    # Without tenants the whole tail is queueing (below); the quiet tenant's part of it is
    # the flood's: 99% of the prompt tokens beside its waits.
    for m in ("ttft", "e2el"):
        assert shares(d, m) == {"noisy_neighbour": 0.657, "queueing": 0.341}
    nn = d.tails["ttft"].causes[0]
    assert nn.evidence == {
        "tenant": "flood", "victims": ["quiet"], "share_of_prompt_tokens_beside_victims": 0.986,
        "share_of_all_prompt_tokens": 0.986, "victim_tail_samples": 2}
    assert nn.advice.startswith("tenant 'flood' sent 99% of the prompt tokens queued or "
                                "prefilled while 'quiet' waited: give each tenant its own key")
    assert d.findings[0].startswith("TTFT: P50 19210.1 ms, P99 38306.1 ms: 66% of the tail is "
                                    "noisy_neighbour (then queueing 34%). tenant 'flood' sent")


def test_tenants_that_load_the_server_alike_are_nobody_s_noisy_neighbour() -> None:
    result = labelled(simulate(Sim(n=300, rate=12, prompt=_flood, per_prefill_s=0.0002,
                                   max_num_seqs=4, seed=11)),
                      lambda q: "a" if q["index"] % 2 else "b")
    d = diagnose(run_from_result(result))
    assert all("noisy_neighbour" not in shares(d, m) for m in d.tails)
    plain = diagnose(run_from_result(simulate(Sim(n=300, rate=12, prompt=_flood,
                                                  per_prefill_s=0.0002, max_num_seqs=4,
                                                  seed=11))))
    assert {m: shares(plain, m) for m in plain.tails} == {m: shares(d, m) for m in d.tails}
