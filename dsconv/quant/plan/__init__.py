"""What a quantize run is asked and decides: the per-linear plan (plan), the options (options), the per-engine recipe
(recipe) and the report with its fallback decision (report)."""
