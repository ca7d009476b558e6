"""``--help`` that shows every option's default, for every command of the CLI."""

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``. An option whose default is None says in its
    help what that comes to (a model's, a device's), else "(default: none)" is added."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.nargs == 0 or not action.option_strings:   # a flag, a positional, a subcommand
            return action.help
        if "default" in action.help:   # the help says it in its own words
            return action.help
        if action.default is None:
            return f"{action.help} (default: none)"
        return super()._get_help_string(action)


def show_defaults(top: argparse.ArgumentParser) -> None:
    """The defaults formatter for every command (subparsers do not inherit it), and a help
    line for options written without one, so that their defaults show too."""
    stack = [top]
    while stack:
        command = stack.pop()
        command.formatter_class = DefaultsHelpFormatter
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            elif action.help is None and action.option_strings and action.nargs != 0:
                action.help = "(default: none)" if action.default is None else "(default: %(default)s)"
