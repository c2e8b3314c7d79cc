"""Prior methods the paper compares against: the vanilla (exact) rule, LANTERN, LANTERN++, SJD."""
