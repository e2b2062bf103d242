"""Per-step metrics of multi-turn rollouts, from each trajectory's record (column ``trajectory``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from mmrl.agent.tools import ERROR_KINDS
from mmrl.agent.trajectory import STOP_REASONS, TrajectoryRecord


def trajectory_metrics(records: Sequence[TrajectoryRecord | None]) -> dict[str, float]:
    """``agent/...``: model turns, tool calls (all and per tool) and observation tokens per trajectory;
    errors by kind (timeouts included) as counts in the batch; tool seconds (mean and max per call);
    the fraction of trajectories that ended by each stop reason (answer, max_turns, budget)."""
    records = [record for record in records if record is not None]
    if not records:
        return {}
    count = len(records)
    calls = [call for record in records for call in record.calls]
    metrics = {
        "agent/turns/mean": sum(record.model_turns for record in records) / count,
        "agent/turns/max": float(max(record.model_turns for record in records)),
        "agent/tool_calls/mean": len(calls) / count,
        "agent/observation_tokens/mean": sum(record.observation_tokens for record in records) / count,
        "agent/tool_seconds/mean": sum(call.seconds for call in calls) / len(calls) if calls else 0.0,
        "agent/tool_seconds/max": max((call.seconds for call in calls), default=0.0),
    }
    errors = Counter(call.error for call in calls if call.error is not None)
    metrics.update({f"agent/errors/{kind}": float(errors[kind]) for kind in ERROR_KINDS})
    metrics.update(
        {f"agent/tool_calls/{name}": float(n) for name, n in Counter(c.name for c in calls).items()}
    )
    stops = Counter(record.stop for record in records)
    metrics.update({f"agent/stop/{reason}": stops[reason] / count for reason in STOP_REASONS})
    return metrics


def trajectory_log(record: TrajectoryRecord) -> dict:
    """What the generations log shows of a trajectory: how it ended, each turn's text, and each call
    (name, arguments, error, seconds, the output text shown, the media returned)."""
    return {
        "stop": record.stop,
        "turns": list(record.turn_texts),
        "calls": [
            {
                "name": call.name,
                "arguments": call.arguments,
                "error": call.error,
                "seconds": round(call.seconds, 4),
                "output": call.output,
                "media": list(call.media),
            }  # fmt: skip
            for call in record.calls
        ],
    }
