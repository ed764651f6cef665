#include "util/file_util.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace flash_reasoning {

Status read_file(const std::string& path, const char* what, std::string* out) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    int err = errno;
    Code code = (err == ENOENT || err == ENOTDIR) ? Code::kNotFound : Code::kIoError;
    return Status::Error(code,
                         std::string(what) + " not found or unreadable: " + path + " (" + std::strerror(err) + ")");
  }
  out->clear();
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out->append(buf, n);
  bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return Status::Error(Code::kIoError, std::string("error reading ") + what + ": " + path);
  return Status::Ok();
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

}  // namespace flash_reasoning

namespace flash_reasoning {

Status list_folders_with(const std::string& dir, const std::string& marker, std::vector<std::string>* out) {
  DIR* d = opendir(dir.c_str());
  if (!d)
    return Status::Error(Code::kNotFound, "artifact folder " + dir + " cannot be opened: " + std::strerror(errno));
  out->clear();
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    struct stat info;
    if (name[0] != '.' && stat(join_path(join_path(dir, name), marker).c_str(), &info) == 0) out->push_back(name);
  }
  closedir(d);
  std::sort(out->begin(), out->end());
  return Status::Ok();
}

}  // namespace flash_reasoning
