//! The text machinery every format's stream shares: finding the first of a set of tags,
//! holding back a suffix that may still grow into one, and trimming a stream as `str::trim`
//! trims the whole.

/// The length of the longest suffix of `text` that is a proper prefix of `tag`, i.e. what must
/// be held back because the tag may still be completed by the next piece.
pub(crate) fn partial_tag_len(text: &str, tag: &str) -> usize {
    let max = text.len().min(tag.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&k| tag.is_char_boundary(k) && text.ends_with(&tag[..k]))
        .unwrap_or(0)
}

/// The longest suffix of `text` that is a proper prefix of any of `tags`.
pub(crate) fn held_back(text: &str, tags: &[&str]) -> usize {
    tags.iter()
        .map(|t| partial_tag_len(text, t))
        .max()
        .unwrap_or(0)
}

/// The first of `tags` in `text`: its byte offset and the tag (the longest, where two start
/// at the same place).
pub(crate) fn find_first<'t>(text: &str, tags: &[&'t str]) -> Option<(usize, &'t str)> {
    tags.iter()
        .filter_map(|&t| text.find(t).map(|i| (i, t)))
        .min_by_key(|&(i, t)| (i, std::cmp::Reverse(t.len())))
}

/// Trims a stream of text the way `str::trim` trims the whole: leading whitespace is dropped,
/// and whitespace is held back until something other than whitespace follows it.
#[derive(Debug, Default)]
pub(crate) struct Trimmer {
    started: bool,
    pending: String,
}

impl Trimmer {
    /// The part of `piece` that can be shown now (possibly empty).
    pub(crate) fn push(&mut self, piece: &str) -> String {
        let piece = if self.started {
            piece
        } else {
            piece.trim_start()
        };
        if piece.is_empty() {
            return String::new();
        }
        self.started = true;
        let body = piece.trim_end();
        if body.is_empty() {
            self.pending.push_str(piece);
            return String::new();
        }
        let mut out = std::mem::take(&mut self.pending);
        out.push_str(body);
        self.pending.push_str(&piece[body.len()..]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_tags_are_held_back() {
        assert_eq!(partial_tag_len("abc <too", "<tool_call>"), 4);
        assert_eq!(partial_tag_len("abc <tool_call>", "<tool_call>"), 0);
        assert_eq!(partial_tag_len("x<", "<tool_call>"), 1);
        // A multi-byte tag is held back at its character boundaries only.
        assert_eq!(partial_tag_len("a<｜tool", "<｜tool▁calls▁begin｜>"), 8);
        assert_eq!(
            held_back("a <mini", &["<tool_call>", "<minimax:tool_call>"]),
            5
        );
    }

    #[test]
    fn the_first_tag_wins_and_the_longest_at_one_place() {
        assert_eq!(find_first("x <b> <a>", &["<a>", "<b>"]), Some((2, "<b>")));
        assert_eq!(
            find_first("<|end|>", &["<|end", "<|end|>"]),
            Some((0, "<|end|>"))
        );
        assert_eq!(find_first("none", &["<a>"]), None);
    }

    #[test]
    fn a_trimmed_stream_is_the_trimmed_whole() {
        let mut t = Trimmer::default();
        let pieces = ["  \n", "a ", " ", "b\n", "\n"];
        let shown: String = pieces.iter().map(|p| t.push(p)).collect();
        assert_eq!(shown, pieces.concat().trim());
    }
}
