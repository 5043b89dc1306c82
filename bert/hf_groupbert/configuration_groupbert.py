"""GroupBertConfig: the sizes of a GroupBERT in transformers (remote code, written by the
GroupBERT project's `bert.py export-hf`; it imports only transformers)."""
from transformers import PretrainedConfig

__all__ = ["GroupBertConfig"]


class GroupBertConfig(PretrainedConfig):
    """BertConfig's keys (without the ones GroupBERT fixes: erf GELU, absolute positions)
    plus the GroupBERT structure: the convolution's kernel and channels per group, and the
    groups of the grouped FFN (Chelombiev et al. 2021, "GroupBERT"). Labels are transformers'
    own `num_labels` / `id2label` / `label2id` / `problem_type`."""

    model_type = "groupbert"

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        max_position_embeddings: int = 512,
        type_vocab_size: int = 2,
        layer_norm_eps: float = 1e-12,
        conv_kernel_size: int = 7,
        conv_group_size: int = 16,
        ffn_groups: int = 4,
        hidden_dropout_prob: float = 0.0,
        attention_probs_dropout_prob: float = 0.0,
        initializer_range: float = 0.02,
        pad_token_id: int = 0,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.layer_norm_eps = layer_norm_eps
        self.conv_kernel_size = conv_kernel_size  # odd: "same" padding of kernel // 2 each side
        self.conv_group_size = conv_group_size  # channels per convolution group: hidden_size / it groups
        self.ffn_groups = ffn_groups  # blocks of the FFN's block-diagonal down-projection
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.initializer_range = initializer_range
        self.pad_token_id = pad_token_id
        super().__init__(**kwargs)
