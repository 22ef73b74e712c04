from kvbench.cli import app

app()
