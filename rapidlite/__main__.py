from rapidlite.cli.main import console

console()
