"""Chat data for supervised fine-tuning (--sft): conversations straight from JSONL, Parquet or a `datasets`
directory, tokenized with the model's own chat template, the loss on the assistant's tokens, packed.

What a row may be (the formats people bring):
- `messages`: [{"role", "content"}, ...] (OpenAI style; ShareGPT converted to messages);
- `conversations`: [{"from", "value"}, ...] (ShareGPT; human -> user, gpt -> assistant);
- `instruction` / `input` / `output` (+ optional `system`): Alpaca, one user turn and one answer;
- `prompt` / `completion` (strings or message lists): TRL's prompt-completion rows;
- `input_ids` (+ `labels` with -100 where no loss is taken): already tokenized.

The loss mask: the template's `{% generation %}` spans where it has them (transformers'
`apply_chat_template(return_assistant_tokens_mask=True)`), otherwise found in the conversation rendered once:
its user and assistant messages located in order in the text (as written, or trimmed as templates trim them),
each assistant message's span its text and the special token the template closes the turn with, the tokens
overlapping a span marked as transformers marks a `{% generation %}` span. This holds for templates that move
or drop the system prompt (Mistral v0.3 folds it into the last user turn, Gemma 3 into the first) or add one
(Qwen2.5), and equals a tagged twin's mask for ChatML, Llama 3, Mistral, Gemma and DeepSeek templates.

Packing: conversations, shuffled by the seed, fill windows of seq_length + 1 tokens in order, each followed by
a separator token that the template never emits; the model's packed-document masks and positions
(--reset-attention-mask / --reset-position-ids, hybrid.model.sequence) split the windows at it, so no token
attends across conversations and each conversation's positions start at 0: the same numbers as the
conversation alone. The separator and the rest of a window take no loss.

The package: `rows` (the rows people bring), `template` (the chat template and the loss mask), `cache` (tokenized
files kept and launch/preprocess_data.py --sft's files), `packing`, `dataset` (the packed windows as datasets),
`stream` (--sft-streaming), `options` (the --sft-* / --dpo-* options and the counts).

Modules:
  rows      a row's formats -> messages (or a refusal naming the file and line)
  template  the model's chat template and the assistant's loss mask
  options   the chat flags as one record
  cache     tokenized conversations cached, keyed by all they depend on
  packing   conversations packed into windows, each whole
  dataset   the windows as a dataset
  stream    --sft-streaming
"""
