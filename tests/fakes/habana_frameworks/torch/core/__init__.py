from habana_frameworks.torch import RECORD


def mark_step() -> None:
    RECORD["mark_step"] += 1
    RECORD["events"].append("mark_step")
