"""Hand-made runs for the report tools' tests: a metrics.jsonl of given per-step rewards."""
import json


def write_rewards(folder, values) -> None:
    """``folder``/metrics.jsonl with one step per value of ``values`` (its reward_mean)."""
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward_mean": v}) + "\n"
                                                  for i, v in enumerate(values)))
