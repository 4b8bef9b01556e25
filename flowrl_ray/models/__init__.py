"""Networks. Pure torch: no Ray here."""
