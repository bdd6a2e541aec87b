from pulsectl.cli.app import run

run()
