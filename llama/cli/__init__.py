"""The command-line tools. Only this layer prints or exits."""
