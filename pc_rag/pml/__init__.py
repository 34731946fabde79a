"""PML, the Prompt Markup Language of Prompt Cache (Gim et al., MLSys 2024): schemas and prompts → segments.

A *schema* declares reusable text once; a *prompt* picks parts of it and adds fresh text:

    <schema name="legal">
      <system>You are a lawyer.</system>
      <module name="contract">Contract text ...</module>
      <module name="statute">Statute text ...</module>
      <module name="letter">Dear <parameter name="client" length="4"/>, about your case</module>
      <union scaffold="en">
        <module name="en">Answer in English.</module>
        <module name="fr">Answer in French.</module>
      </union>
    </schema>

    <prompt schema="legal"><contract/><letter client="Ms Smith"/><fr/>
      <user>Can I cancel?</user><assistant/></prompt>

`SchemaRegistry.segments(prompt)` turns a prompt into the `Text` / `Chunk` list the engine runs.

Text. Text directly in `<schema>` is always included. Module text is cached: each run of module text between
parameters and child modules becomes one `Chunk`. Parameter arguments and all prompt text are fresh `Text`.
Text is used verbatim, except that a run made only of whitespace that contains a line break is layout
(indentation between tags) and is dropped; write `<module name="m">text</module>` on one line when you do
not want line breaks in your tokens.

Positions. The schema is laid out once: a BOS sink at 0 when the tokenizer has one, then every piece in
document order, union members all starting at the union's start (the union takes its longest member's
length), a parameter reserving `length` positions. A module's KV is always encoded at its schema position
(`Chunk.encode_position`), so it is the same cache entry whatever prompt uses it. Where a prompt puts it:

* schema layout (the paper's): imported pieces keep their schema positions, so a prompt that imports a
  subset has gaps; fresh text goes right after the last segment before it. Used when the schema is no
  longer than `schema_budget` positions (default: half of `max_positions`, leaving the other half for the
  question and the answer) and the prompt's fresh text does not run into the positions of a module
  imported after it.
* compact layout: otherwise (e.g. a RAG schema of thousands of chunks, far longer than the context).
  Everything the prompt uses is packed in order from the start, each piece relocated from its schema
  position (`position` = packed position, `encode_position` = schema position; the core's RoPE rotation
  moves the cached keys). Parameters keep their reserved width, so offsets inside a module are the same
  in both layouts. The fresh text then follows the last imported module, whatever the schema's size.

Either way a prompt that ends past `max_positions` is a `PMLError`.

Order. Imports must appear in schema order (the schema fixes where cached text sits). Free text is never
dropped: written after an import (or at the start), it follows that import and any always-included schema
text up to the next imported module.

Chat roles. `<system>`, `<user>` and `<assistant>` are rendered through the tokenizer's own chat template,
not hard-coded per model: `chat_roles` renders a conversation whose contents are placeholders with
`apply_chat_template` and cuts the text around the placeholders into each role's prefix and suffix (the
generation prompt gives the assistant prefix). A template that trims message contents gets trimmed role
contents here too. In a prompt, a final `<assistant>` element (`<assistant/>` or with a prefilled start) is
left open so the model writes the reply. PML renders only the turns written: a template's implicit default
system message is not added.

Unions. A prompt imports at most one member. `scaffold="member"` is parsed and recorded
(`Schema.unions`), but members are still each encoded on their own (members share their start position,
so "the scaffold member as context" has no single meaning for RoPE; left for later).

Scaffolds. `<scaffold><module .../><module .../></scaffold>` groups modules that are retrieved together:
the layout is as without it, and when a prompt imports the members in order, the engine encodes them
jointly once (each member sees the ones before it) and reuses that block; a member imported alone uses its
own block.

Safety. Parsing uses defusedxml with DTDs, entity declarations and external references forbidden, so entity
expansion and file or network access cannot happen; input over a size cap is refused before parsing.
Every problem is a `pc_rag.PMLError` naming the element and line.
"""

# The package, in dependency order (each module imports only from those above it):
#   parse.py   safe XML parsing into a small node tree; tag/name constants and the name and attribute checks
#   roles.py   chat roles cut out of the tokenizer's chat template
#   schema.py  schema reading and layout at schema positions (Schema, SchemaPiece, ModuleInfo, UnionInfo)
#   prompt.py  SchemaRegistry: schema registration, prompt reading and placement (schema or compact layout)
#   chunks.py  helpers for plain chunk lists (schema_for_chunks, prompt_for, escape_text)

from .chunks import chunk_module_name, escape_text, prompt_for, schema_for_chunks
from .parse import MAX_DEPTH, ROLE_TAGS, parse_pml
from .prompt import PML, SchemaRegistry, equivalent_plain_prompt
from .roles import ChatRoles, chat_roles
from .schema import ModuleInfo, Schema, SchemaPiece, UnionInfo

__all__ = [
    "MAX_DEPTH",
    "ROLE_TAGS",
    "ChatRoles",
    "ModuleInfo",
    "PML",
    "Schema",
    "SchemaPiece",
    "SchemaRegistry",
    "UnionInfo",
    "chat_roles",
    "chunk_module_name",
    "equivalent_plain_prompt",
    "escape_text",
    "parse_pml",
    "prompt_for",
    "schema_for_chunks",
]
