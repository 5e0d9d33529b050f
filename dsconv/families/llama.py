"""Llama (and every model_type that is a Llama under another name)."""
from dsconv.families import register
from dsconv.families.base import Family, llama_rules


@register
class Llama(Family):
    name = "llama"
    model_types = ("llama", "mistral")
    rules = llama_rules()

    def _facts(self, c):
        f = super()._facts(c)
        f.extra["attention_bias"] = bool(c.get("attention_bias", False))
        return f
