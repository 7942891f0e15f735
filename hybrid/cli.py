"""Console entry points (pyproject [project.scripts]); the same functions the launch/ scripts call."""

import sys


def train_main() -> None:
    from hybrid.training.run import main  # each command imports only its own modules (start-up time)
    sys.exit(main())


def preprocess_main() -> None:
    from hybrid.data.preprocess import main  # each command imports only its own modules
    sys.exit(main())


def convert_main() -> None:
    from hybrid.conversion.checkpoint_util import main  # each command imports only its own modules
    sys.exit(main())


def evaluate_main() -> None:
    from hybrid.evaluation import main  # each command imports only its own modules
    sys.exit(main())


def generate_main() -> None:
    from hybrid.generation import main  # each command imports only its own modules
    sys.exit(main())


def serve_main() -> None:
    from hybrid.serving import main  # each command imports only its own modules
    sys.exit(main())
