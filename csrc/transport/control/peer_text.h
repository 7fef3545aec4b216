// Text that another process wrote into shared memory, made safe to show.
#pragma once
#include <cstddef>
#include <string>

namespace hca {

// The text at `text` up to its NUL or `capacity` bytes: printable ASCII and whole UTF-8 characters
// kept (gloo's messages end in an emoji), every other byte '?', so that the message of the Python
// exception it ends up in decodes, whatever a peer left there (a cut character, stray bytes).
std::string peer_text(const char* text, size_t capacity);

}  // namespace hca
