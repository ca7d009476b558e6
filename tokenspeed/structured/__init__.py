"""Structured outputs: constraints on what a request may generate, as token masks.

``StructuredOutputs`` (vLLM's names) is compiled at the door (``compile_grammar``) against
the model's vocabulary as llguidance sees it (``guidance_tokenizer``); each request then
holds a ``GrammarMatcher``, and a ``MaskFiller`` writes a batch's packed bitmask (on the
engine's thread, in llguidance's native code), which ``apply_token_bitmask_`` applies to
the logits. ``TokenBias`` carries ``logit_bias`` and ``allowed_token_ids`` along the same
route. Nothing here imports the engine or the face: they import this.
"""

from tokenspeed.structured.bitmask import apply_token_bitmask_, mask_words, new_bitmask
from tokenspeed.structured.grammar import Grammar, compile_grammar
from tokenspeed.structured.mask_filler import MaskFiller, MaskRow
from tokenspeed.structured.matcher import GrammarMatcher
from tokenspeed.structured.response_format import from_response_format
from tokenspeed.structured.spec import StructuredOutputs
from tokenspeed.structured.token_bias import TokenBias, add_logit_bias_
from tokenspeed.structured.tool_choice import tool_choice_constraint
from tokenspeed.structured.vocabulary import guidance_tokenizer

__all__ = [
    "Grammar", "GrammarMatcher", "MaskFiller", "MaskRow", "StructuredOutputs", "TokenBias",
    "add_logit_bias_", "apply_token_bitmask_", "compile_grammar", "from_response_format",
    "guidance_tokenizer", "mask_words", "new_bitmask", "tool_choice_constraint",
]
