"""The flags of conversations (``dump``, online ``train`` and ``--eval-data``), built into one
``data.ChatOptions`` (docs/DATA.md, "Conversations").

Every flag defaults to "not given", so that ``chat_options`` can tell a command line without any
(``train`` then reads held-out data as the store's data was read) from one that sets them.
"""

from __future__ import annotations

import argparse

FLAGS = {  # flag -> ChatOptions field
    "--data-format": "format",
    "--messages-field": "messages_field",
    "--prompt-field": "prompt_field",
    "--completion-field": "completion_field",
    "--tools-field": "tools_field",
    "--chat-template": "chat_template",
    "--chat-template-kwargs": "template_kwargs",
    "--chat-now": "now",
    "--supervise-roles": "supervise_roles",
    "--no-supervise-end-of-turn": "supervise_end_of_turn",
    "--no-mask-empty-reasoning": "mask_empty_reasoning",
    "--mask-method": "mask_method",
}


def template_kwarg(text: str) -> str:
    """One ``NAME=VALUE`` item of --chat-template-kwargs."""
    name, sep, _ = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. enable_thinking=false), got {text!r}")
    return text


def add_chat_arguments(p, *, applies_to: str) -> None:
    """The chat flags, in their own group; ``applies_to`` names the data they read (for the help)."""
    from ..data import ChatOptions

    d = ChatOptions()
    g = p.add_argument_group(f"conversations ({applies_to}; docs/DATA.md)")
    g.add_argument("--data-format", choices=("auto", "text", "messages", "prompt_completion"), default=None,
                   help="what the records hold (default auto: messages if they have the messages field, prompt_"
                        "completion if they have prompt and completion, else text)")
    g.add_argument("--messages-field", default=None, help=f"field of a conversation's messages (default {d.messages_field})")
    g.add_argument("--prompt-field", default=None, help=f"field of the prompt (default {d.prompt_field})")
    g.add_argument("--completion-field", default=None, help=f"field of the completion (default {d.completion_field})")
    g.add_argument("--tools-field", default=None,
                   help=f"field of the tool schemas passed to the template (default {d.tools_field})")
    g.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template (local or gs://) instead of the tokenizer's (its "
                        "chat_template.jinja, else tokenizer_config.json's chat_template)")
    g.add_argument("--chat-template-kwargs", metavar="NAME=VALUE", nargs="+", action="extend", type=template_kwarg,
                   default=None, help="template keyword arguments, a value read as JSON when it parses (e.g. "
                                      "enable_thinking=false)")
    g.add_argument("--chat-now", metavar="ISO", default=None,
                   help=f"the date the template's strftime_now() formats (default {d.now}: renders never depend on "
                        "the clock)")
    g.add_argument("--supervise-roles", metavar="ROLE", nargs="+", default=None,
                   help="the roles whose turns are trained (default assistant; others use the prefix mask method)")
    g.add_argument("--no-supervise-end-of-turn", action="store_const", const=False, default=None,
                   help="do not train the end-of-turn token (default: trained, so the student learns to stop)")
    g.add_argument("--no-mask-empty-reasoning", action="store_const", const=False, default=None,
                   help="train the tokens of empty reasoning blocks that templates insert (default: not trained)")
    g.add_argument("--mask-method", choices=("auto", "generation", "prefix"), default=None,
                   help="how the supervised tokens are found: the template's {%% generation %%} markers, or by "
                        "rendering prefixes (default auto: markers when the template has them)")


def chat_options(args: argparse.Namespace):
    """The ``ChatOptions`` of the given chat flags (the defaults for the others), or None when none is given."""
    from ..data import ChatOptions, parse_template_kwargs

    given = {}
    for flag, field in FLAGS.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is None:
            continue
        if field == "template_kwargs":
            value = parse_template_kwargs(value)
        elif field == "supervise_roles":
            value = tuple(value)
        given[field] = value
    return ChatOptions(**given) if given else None
