// Whole-file reads with Status errors that name the path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "util/status.h"

namespace flash_reasoning {

// Reads `path` (what it is, e.g. "manifest", names it in errors) into `out`. kNotFound when it
// does not exist; kIoError when it cannot be read, is not a regular file (a FIFO would block,
// a device never end), or holds more than `max_bytes`. Never blocks on the open and never reads
// past the size the file had when opened.
Status read_file(const std::string& path, const char* what, std::string* out, size_t max_bytes = SIZE_MAX);

// Names of the sub-folders of `dir` that hold a file `marker`, sorted. kNotFound when `dir`
// is not a readable folder.
Status list_folders_with(const std::string& dir, const std::string& marker, std::vector<std::string>* out);

// Joins a folder and a relative name with one '/'.
std::string join_path(const std::string& dir, const std::string& name);

}  // namespace flash_reasoning
