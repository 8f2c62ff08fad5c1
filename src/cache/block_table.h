#pragma once
// One cache group's block tables for a step, flat and device-ready: row r
// belongs to the step's run r and maps the request's logical block b
// (entries b*B .. b*B + B - 1, B = entries_per_page) to a page id.
//
// Tables keep only the blocks a later token can still read: row r holds
// blocks first[r] .. first[r] + width - 1 (an SWA table, for example, starts
// at the window's first block), padded with -1. So a row's width follows what
// is live, not the request's length.
#include <cstdint>

namespace dsv4 {

struct BlockTableView {
  const int32_t* pages = nullptr;  // [runs, width], -1 = no page
  const int32_t* first = nullptr;  // [runs] logical block of column 0
  int width = 0;
  int entries_per_page = 1;
};

// Global slot (page * B + offset) of entry `entry` of run r's request, or -1
// when no page holds it. Host and device code share it.
constexpr int32_t block_table_slot(const BlockTableView& t, int r, int64_t entry) {
  if (entry < 0) return -1;
  const int64_t col = entry / t.entries_per_page - t.first[r];
  if (col < 0 || col >= t.width) return -1;
  const int32_t page = t.pages[int64_t(r) * t.width + col];
  return page < 0 ? -1 : int32_t(int64_t(page) * t.entries_per_page + entry % t.entries_per_page);
}

}  // namespace dsv4
