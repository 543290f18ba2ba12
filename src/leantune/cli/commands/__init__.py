"""What each command does, thin over the library: imported only when the command runs
(`leantune.cli.app.main`), so that their imports of torch and transformers cost nothing to
`leantune --help` and to an argument error."""
