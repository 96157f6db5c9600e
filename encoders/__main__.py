"""``python -m encoders`` / ``agentgate encoder``: the encoder service on the model's vision tower
(``encoders.cli``; ``encoders.encode`` builds the decode + preprocess + tower function)."""

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    from encoders.cli import main as cli_main
    from encoders.encode import make_encode_fn

    return cli_main(argv, make_encode_fn, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
