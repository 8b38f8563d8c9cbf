"""The `dspark` command line. Each subcommand lives in `dspark.commands.<name>`."""

from __future__ import annotations

import click

from dspark.commands import bench, calibrate, generate, loadtest, models, profile, serve, train


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="dspark-serve")
def main() -> None:
    """DSpark Serve: confidence-scheduled speculative decoding."""


main.add_command(models.models)
main.add_command(generate.generate)
main.add_command(bench.bench)
main.add_command(profile.profile)
main.add_command(serve.serve)
main.add_command(loadtest.loadtest)
main.add_command(train.train)
main.add_command(calibrate.calibrate)


if __name__ == "__main__":
    main()
