"""The chat templates today's instruct models ship, written to behave as theirs do (the role order they
enforce, what they trim, where they put or drop the system prompt, the special tokens around each turn), each
with a tagged twin: the same template with transformers' {% generation %} markers around what the assistant
writes (its text and the token that closes its turn), whose assistant mask is the reference. And a tokenizer
for each: the embedded byte-level BPE with the family's special tokens."""

from __future__ import annotations

GEN, END = "{% generation %}", "{% endgeneration %}"

# Llama-3-8B-Instruct's template (3.0: no tools, no date header): every turn's content trimmed, closed by
# <|eot_id|>; bos once at the start
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ ('<|begin_of_text|>' if loop.index0 == 0 else '') + '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "@GEN{{ message['content'] | trim }}<|eot_id|>@END"
    "{% else %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Mistral-7B-Instruct-v0.3's: roles must alternate; the system prompt is written only into the last user turn
# when that turn ends the conversation (a prompt), so a whole training conversation drops it
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' }}@GEN{{- message['content'] + eos_token }}@END"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported') }}{%- endif %}"
    "{%- endfor %}"
)

# Gemma 3's: no system role of its own (the system prompt opens the first user turn), the assistant is 'model',
# every content trimmed, turns closed by <end_of_turn> and a newline
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<start_of_turn>model\\n' }}@GEN{{ message['content'] | trim }}<end_of_turn>@END{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<start_of_turn>user\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# Qwen2.5-Instruct's ChatML: its own system prompt when none is given
QWEN25 = (
    "{%- for message in messages %}"
    "{%- if loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}@GEN{{- message['content'] + '<|im_end|>' }}@END{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# DeepSeek-V3's: the system prompt first, bare; user and assistant turns behind their markers, the assistant's
# closed by its end of sentence
DEEPSEEK = (
    "{% set ns = namespace(system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}"
    "{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{{ '<｜Assistant｜>' }}@GEN{{ message['content'] + '<｜end▁of▁sentence｜>' }}"
    "@END{%- endif %}"
    "{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

# family -> (template with @GEN/@END where the generation markers go; bos, eos, pad; other special tokens)
FAMILIES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", None,
               ["<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"]
               + [f"<|reserved_special_token_{k}|>" for k in range(4)]),
    "mistral": (MISTRAL, "<s>", "</s>", None, ["<unk>", "[INST]", "[/INST]"] + [f"[control_{k}]" for k in range(4)]),
    "gemma": (GEMMA, "<bos>", "<eos>", "<pad>", ["<start_of_turn>", "<end_of_turn>"]),
    "qwen25": (QWEN25, None, "<|im_end|>", "<|endoftext|>", ["<|im_start|>"]),
    "deepseek": (DEEPSEEK, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                 ["<｜User｜>", "<｜Assistant｜>", "<｜fim▁hole｜>", "<｜tool▁calls▁begin｜>"]),
}


def template(family: str, tagged: bool) -> str:
    """The family's template as shipped (no markers) or its tagged twin."""
    text = FAMILIES[family][0]
    return text.replace("@GEN", GEN if tagged else "").replace("@END", END if tagged else "")


def family_tokenizer(family: str, tagged: bool = False):
    """The embedded byte-level BPE with the family's special tokens (bos, eos, pad as the family sets them: Llama 3
    and Mistral have no pad) and its template."""
    from transformers import Qwen2Tokenizer

    from checks.launch_helpers import MERGES, VOCAB
    _, bos, eos, pad, others = FAMILIES[family]
    tok = Qwen2Tokenizer(vocab=VOCAB, merges=MERGES, unk_token=None, bos_token=bos, eos_token=eos, pad_token=pad)
    tok.add_tokens(others, special_tokens=True)  # special, but not in all_special_tokens (as Llama 3's reserved)
    tok.chat_template = template(family, tagged)
    return tok
