"""Fleet-scale simulations (standard library only; matplotlib optional for plots)."""
