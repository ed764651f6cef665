// Whole-file reads with Status errors that name the path.
#pragma once

#include <string>
#include <vector>

#include "util/status.h"

namespace flash_reasoning {

// Reads `path` into `out`. kNotFound when the file does not exist, kIoError otherwise.
Status read_file(const std::string& path, const char* what, std::string* out);

// Names of the sub-folders of `dir` that hold a file `marker`, sorted. kNotFound when `dir`
// is not a readable folder.
Status list_folders_with(const std::string& dir, const std::string& marker, std::vector<std::string>* out);

// Joins a folder and a relative name with one '/'.
std::string join_path(const std::string& dir, const std::string& name);

}  // namespace flash_reasoning
