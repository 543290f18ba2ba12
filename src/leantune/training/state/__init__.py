"""What a checkpoint holds and how it is written, verified and read back (`checkpoint`,
`verify`), and the loop's progress that a checkpoint carries (`progress`)."""
