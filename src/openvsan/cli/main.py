"""The `vsan` command (placeholder until the node lands)."""


def main() -> None:
    raise SystemExit("vsan: not built yet")
