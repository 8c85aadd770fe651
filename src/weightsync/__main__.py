"""`python -m weightsync`: the same command line as the `weightsync` script."""

from weightsync.cli.main import app

if __name__ == "__main__":
    app(prog_name="weightsync")
