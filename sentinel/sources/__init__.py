"""Signal sources: each yields typed readings or events and decides nothing."""
