"""attest: is a server running the model it claims? The experiment (`experiment`), its payloads (`payloads`), the
claimed model's honest variants (`variants`), its item function (`item`), its statistics and decision (`stats`,
`decision`), its summary and tables (`summary`, `tables`), and two runs compared (`compare`)."""
