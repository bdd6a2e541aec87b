from pulsectl.cli.entry import run

run()
