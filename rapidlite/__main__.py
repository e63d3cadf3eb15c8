from rapidlite.cli import console

console()
