"""Risk-removal commands run before spending GPU hours: `oneloop eval`, `oneloop inspect`,
`oneloop size`."""
